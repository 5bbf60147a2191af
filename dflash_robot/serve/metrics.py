"""Prometheus metrics, in a registry of the app's own (so that apps do not share counters),
and an ASGI middleware that counts every HTTP request by endpoint and status.

Speculative-decoding counters follow the `StepEvent`s: a verify step is an event with an
acceptance length (the prefill is not one); it drafted `block_size - 1` tokens, of which
`acceptance_length - 1` were accepted (the remaining committed token is the target's own)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ACCEPT = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "prompt tokens of requests that ran", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "tokens generated (committed)", registry=r)
        self.verify_steps = Counter("dflash_verify_steps", "draft-and-verify steps (drafts)", registry=r)
        self.draft_tokens = Counter("dflash_draft_tokens", "tokens drafted: sum of block_size - 1 over steps",
                                    registry=r)
        self.accepted_tokens = Counter("dflash_accepted_tokens",
                                       "drafted tokens accepted: sum of acceptance_length - 1 over steps", registry=r)
        self.acceptance_length = Histogram("dflash_acceptance_length",
                                           "tokens committed per verify step (accepted drafts + 1)",
                                           buckets=_ACCEPT, registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds",
                              "from the request entering the queue to its first token", buckets=_LATENCY, registry=r)
        self.token_latency = Histogram("dflash_inter_token_latency_seconds",
                                       "per generated token after the first: its step's wall time / tokens the "
                                       "step committed", buckets=_LATENCY, registry=r)
        self.cancelled = Counter("dflash_requests_cancelled", "requests dropped before their end because the "
                                 "client went away (or the server stopped)", registry=r)
        self.queue_depth = Gauge("dflash_queue_depth", "requests waiting behind the running one", registry=r)
        self.running = Gauge("dflash_requests_running", "requests being generated (0 or 1)", registry=r)

    def step(self, tokens: int, acceptance_length: int | None, block_size: int, seconds: float) -> None:
        """Record one StepEvent; `seconds` is its wall time (the prefill's counts as TTFT elsewhere)."""
        self.generated_tokens.inc(tokens)
        if acceptance_length is None:
            return
        self.verify_steps.inc()
        self.draft_tokens.inc(block_size - 1)
        self.accepted_tokens.inc(acceptance_length - 1)
        self.acceptance_length.observe(acceptance_length)
        for _ in range(tokens):
            self.token_latency.observe(seconds / tokens)


class RequestCounter:
    """ASGI middleware: `dflash_requests_total{endpoint, status}` for every HTTP request.
    Paths outside `endpoints` are counted as "other" (bounded label values)."""

    def __init__(self, app: Any, metrics: Metrics, endpoints: frozenset[str]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def counting_send(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        path = scope.get("path", "")
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(path if path in self.endpoints else "other", str(status)).inc()
