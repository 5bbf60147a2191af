"""The single worker that owns the runtime: requests wait in a FIFO queue and run one at a
time on a dedicated thread (the runtime is not thread-safe); each step's text goes back to
the request's asyncio queue as it is committed.

A cancelled request (its client went away) leaves the queue at once, or, when running,
stops at the worker's next step: the step generator is closed, which frees the engine."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dflash_robot.runtime.text import TextStream
from dflash_robot.serve.errors import Cancelled, ShuttingDown
from dflash_robot.serve.metrics import Metrics

log = logging.getLogger("dflash_robot.serve")


@dataclass
class SpecStats:
    """One request's token counts and speculative statistics (see `metrics.py`)."""

    prompt_tokens: int
    completion_tokens: int = 0
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_sum: int = 0

    def add(self, tokens: int, acceptance_length: int | None, block_size: int) -> None:
        self.completion_tokens += tokens
        if acceptance_length is not None:
            self.verify_steps += 1
            self.draft_tokens += block_size - 1
            self.accepted_tokens += acceptance_length - 1
            self.acceptance_sum += acceptance_length

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def dflash(self) -> dict[str, float | int]:
        mean = self.acceptance_sum / self.verify_steps if self.verify_steps else 0.0
        return {"mean_acceptance_length": mean, "verify_steps": self.verify_steps,
                "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens}


@dataclass
class Delta:
    text: str  # may be empty: the step's text is held back (partial UTF-8, a possible stop string)


@dataclass
class Finished:
    reason: str  # "stop" | "length"
    stats: SpecStats


@dataclass
class Failed:
    error: BaseException


Update = Delta | Finished | Failed


@dataclass
class Job:
    """One request: prompt ids, settings, and the asyncio queue its updates arrive on."""

    ids: list[int]
    cfg: Any  # GenerationConfig
    stop: tuple[str, ...]
    policy: Any  # BlockSizePolicy | None
    loop: asyncio.AbstractEventLoop
    updates: asyncio.Queue[Update] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)  # its last update is on the way
    submitted: float = field(default_factory=time.perf_counter)

    def put(self, update: Update) -> None:
        """Hand an update to the request's event loop (from any thread)."""
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class QueueFull(Exception):
    pass


class Engine:
    """FIFO queue + one worker thread around a `DFlashRuntime`."""

    def __init__(self, runtime: Any, metrics: Metrics, max_queue: int):
        self.rt, self.metrics, self.max_queue = runtime, metrics, max_queue
        self.tokenizer_lock = threading.Lock()  # the worker decodes while handlers encode
        self._pending: deque[Job] = deque()
        self._cv = threading.Condition()
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="dflash-serve-engine", daemon=True)

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._pending)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, drop waiting ones, stop the running one at its next step."""
        with self._cv:
            self._stopping = True
            dropped = list(self._pending)
            self._pending.clear()
            self.metrics.queue_depth.set(0)
            if self._running is not None:
                self._running.cancelled.set()
            self._cv.notify_all()
        for job in dropped:
            job.finished.set()
            job.put(Failed(ShuttingDown()))
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queue `job`; raises QueueFull when `max_queue` requests already wait."""
        with self._cv:
            if self._stopping:
                raise ShuttingDown()
            busy = self._running is not None or self._pending
            if busy and len(self._pending) >= self.max_queue:
                raise QueueFull()
            self._pending.append(job)
            self.metrics.queue_depth.set(len(self._pending))
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Drop `job`: out of the queue now, or stopped at the worker's next step (no-op
        once it finished)."""
        with self._cv:
            if job.finished.is_set() or job.cancelled.is_set():
                return
            job.cancelled.set()
            self.metrics.cancelled.inc()
            try:
                self._pending.remove(job)
            except ValueError:
                return  # running (or not submitted): the worker sees the flag
            self.metrics.queue_depth.set(len(self._pending))
        job.finished.set()
        job.put(Failed(Cancelled()))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                job = self._running = self._pending.popleft()
                self.metrics.queue_depth.set(len(self._pending))
            self.metrics.running.set(1)
            try:
                final = self._run(job)
            except Exception as e:  # a bug: answer the request, keep serving
                log.exception("request failed")
                final = Failed(e)
            finally:
                self.metrics.running.set(0)
                with self._cv:
                    self._running = None
            job.finished.set()  # before the last update, so that a late cancel() is a no-op
            job.put(final)

    def _run(self, job: Job) -> Finished | Failed:
        """Run `job` to its end, handing over each step's text; -> its last update."""
        if job.cancelled.is_set():
            return Failed(ShuttingDown() if self._stopping else Cancelled())
        stats = SpecStats(prompt_tokens=len(job.ids))
        text = TextStream(self.rt.tokenizer, job.stop)
        gen = self.rt.orchestrator.stream(job.ids, job.cfg, job.policy)
        reason: str | None = None
        last = job.submitted
        try:
            self.metrics.prompt_tokens.inc(len(job.ids))
            for ev in gen:
                now = time.perf_counter()
                if ev.acceptance_length is None:
                    self.metrics.ttft.observe(now - job.submitted)
                self.metrics.step(len(ev.tokens), ev.acceptance_length, ev.block_size, now - last)
                last = now
                stats.add(len(ev.tokens), ev.acceptance_length, ev.block_size)
                with self.tokenizer_lock:
                    delta = text.push(ev.tokens)
                reason = "stop" if text.stopped else ev.finish_reason
                job.put(Delta(delta))
                if reason is not None or job.cancelled.is_set():
                    break
        except Exception as e:
            return Failed(e)
        finally:
            gen.close()  # frees the engine now, also when the request stops early
        if reason is None and job.cancelled.is_set():
            return Failed(ShuttingDown() if self._stopping else Cancelled())
        with self.tokenizer_lock:
            tail = text.finish()
        if tail:
            job.put(Delta(tail))
        return Finished(reason or "length", stats)
