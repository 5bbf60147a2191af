"""Load test for `dflash-robot serve`: C concurrent streaming clients (the openai client)
send R requests in all, within a time bound, to a server on this machine only.

    python scripts/load_test.py --requests 32 --concurrency 4 --max-tokens 64
    python scripts/load_test.py --base-url http://127.0.0.1:8000/v1 --json out.json

Reports requests/s, output tokens/s, time to first token (TTFT) and inter-token latency
(ITL) percentiles, the inter-chunk gaps, the mean acceptance length the server reported
("dflash" extension) and errors by kind. TTFT: request sent -> first text chunk. ITL per
request: (last chunk - first chunk) / (completion tokens - 1). A request is an error if it
raised, or ended without a finish_reason.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
MAX_REQUESTS = 10_000
MAX_DURATION_S = 3600
PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a string.",
    "List three uses of speculative decoding.",
    "What is 17 * 23? Answer briefly.",
    "Give a one-line summary of the water cycle.",
    "Name four prime numbers greater than 50.",
    "Translate 'good morning' into French and Spanish.",
    "Why is the sky blue? One paragraph.",
]


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    mean_acceptance_length: float | None = None


def percentiles(xs: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (None without data)."""
    s = sorted(xs)
    return {f"p{p}": (s[min(len(s) - 1, max(0, -(-p * len(s) // 100) - 1))] if s else None) for p in ps}


def one_request(client, args: argparse.Namespace, model: str, prompt: str) -> Result:
    res = Result()
    t0 = time.perf_counter()
    first = last = None
    reason = None
    try:
        common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                      stream_options={"include_usage": True})
        if args.completions:
            stream = client.completions.create(prompt=prompt, **common)
        else:
            stream = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.completion_tokens = chunk.usage.completion_tokens
                extra = chunk.model_extra or {}
                res.mean_acceptance_length = (extra.get("dflash") or {}).get("mean_acceptance_length")
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            text = ch.text if args.completions else ch.delta.content
            if text:
                if first is None:
                    first = now
                else:
                    res.gaps_s.append(now - last)
                last = now
            reason = ch.finish_reason or reason
    except Exception as e:  # counted by kind, never fatal
        res.error = type(e).__name__
        return res
    if reason is None:
        res.error = "no finish_reason"
        return res
    res.ok = True
    if first is not None:
        res.ttft_s = first - t0
        if res.completion_tokens > 1 and last is not None:
            res.itl_s = (last - first) / (res.completion_tokens - 1)
    return res


def run(args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "unused", max_retries=0,
                           timeout=args.timeout)
    try:
        model = args.model or client.models.list().data[0].id
    except openai.OpenAIError as e:
        raise SystemExit(f"load_test: cannot list the server's models at {args.base_url}: {e}") from None
    results: list[Result] = []
    lock = threading.Lock()
    issued = 0
    deadline = time.monotonic() + args.duration

    def worker() -> None:
        nonlocal issued
        while True:
            with lock:
                if issued >= args.requests or time.monotonic() >= deadline:
                    return
                i = issued
                issued += 1
            r = one_request(client, args, model, PROMPTS[i % len(PROMPTS)])
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(args.concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    acc = [r.mean_acceptance_length for r in ok if r.mean_acceptance_length is not None]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "base_url": args.base_url, "model": model, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "endpoint": "completions" if args.completions else "chat.completions",
        "requests": len(results), "succeeded": len(ok), "errors": dict(Counter(r.error for r in results if r.error)),
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tokens_per_s": tokens / wall if wall > 0 else 0.0, "completion_tokens": tokens,
        "ttft_s": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": percentiles([r.itl_s for r in ok if r.itl_s is not None]),
        "chunk_gap_s": percentiles([g for r in ok for g in r.gaps_s]),
        "mean_acceptance_length": sum(acc) / len(acc) if acc else None,
    }


def _fmt(p: dict[str, float | None]) -> str:
    return "  ".join(f"{k} {v * 1000:.1f} ms" if v is not None else f"{k} -" for k, v in p.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL (loopback only)")
    ap.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    ap.add_argument("--api-key", help="the server's --api-key, if it has one")
    ap.add_argument("--requests", type=int, default=32, help=f"requests in all (at most {MAX_REQUESTS})")
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent streaming clients")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--duration", type=float, default=300,
                    help=f"no new request after this many seconds (at most {MAX_DURATION_S})")
    ap.add_argument("--timeout", type=float, default=300, help="per-request client timeout, seconds")
    ap.add_argument("--completions", action="store_true", help="use /v1/completions instead of chat")
    ap.add_argument("--json", help="also write the report to this JSON file")
    args = ap.parse_args(argv)
    host = urlparse(args.base_url).hostname
    if host not in LOOPBACK:
        ap.error(f"refusing {args.base_url}: this script only loads a server on this machine "
                 f"({', '.join(sorted(LOOPBACK))})")
    if not 1 <= args.requests <= MAX_REQUESTS or not 1 <= args.concurrency <= args.requests:
        ap.error(f"need 1 <= --concurrency <= --requests <= {MAX_REQUESTS}")
    if not 0 < args.duration <= MAX_DURATION_S or args.max_tokens < 1 or args.timeout <= 0:
        ap.error(f"need 0 < --duration <= {MAX_DURATION_S}, --max-tokens >= 1, --timeout > 0")
    report = run(args)
    print(f"{report['requests']} requests ({report['succeeded']} ok, errors: {report['errors'] or 'none'}) "
          f"in {report['wall_s']:.1f} s with {args.concurrency} concurrent streams: "
          f"{report['requests_per_s']:.2f} req/s, {report['output_tokens_per_s']:.1f} output tok/s")
    print(f"TTFT         {_fmt(report['ttft_s'])}")
    print(f"ITL          {_fmt(report['itl_s'])}")
    print(f"chunk gaps   {_fmt(report['chunk_gap_s'])}")
    if report["mean_acceptance_length"] is not None:
        print(f"mean acceptance length (server-reported) {report['mean_acceptance_length']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["succeeded"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
