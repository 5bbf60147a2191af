"""The FastAPI app: OpenAI-compatible /v1/chat/completions, /v1/completions and /v1/models,
plus /health and /metrics, over one `DFlashRuntime` served by one worker (`engine.py`).

A request is validated, tokenized and checked against the context here, so that bad input
is a 4xx before it queues; the answer (streamed or not) starts once the request's first
token exists, so an error the runtime raises at its start is still a 4xx."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from dflash_robot.errors import ConfigError, DFlashError
from dflash_robot.serve.engine import Delta, Engine, Failed, Finished, Job, QueueFull, Update
from dflash_robot.serve.errors import ApiError, ShuttingDown, from_exception
from dflash_robot.serve.formats import DONE, Format, sse
from dflash_robot.serve.metrics import Metrics, RequestCounter
from dflash_robot.serve.schemas import ChatRequest, CompletionRequest, parse
from dflash_robot.serve.settings import ServeSettings

log = logging.getLogger("dflash_robot.serve")
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"})


def create_app(runtime: Any, settings: ServeSettings | None = None) -> FastAPI:
    """An app serving `runtime` (a ready `DFlashRuntime` with a tokenizer); the worker
    thread starts and stops with the app's lifespan."""
    s = settings or ServeSettings()
    if runtime.tokenizer is None:
        raise ConfigError("the server answers in text and needs a target with a tokenizer")
    metrics = Metrics()
    engine = Engine(runtime, metrics, s.max_queue)
    policy = runtime.adaptive_policy(s.cost_cache) if s.adaptive else None  # one policy: it learns across requests
    top_block = runtime.draft.metadata.training_block_size if runtime.draft is not None else 1
    if s.block_size is not None and s.block_size > top_block:
        raise ConfigError(f"block_size {s.block_size} is out of range: this draft supports 1..{top_block}")
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app = FastAPI(title="dflash-robot", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.settings = engine, metrics, s
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    _add_error_handlers(app)

    def authorize(request: Request) -> None:
        if s.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), s.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def prepare(req: Any, chat: bool) -> Job:
        """Settings, prompt ids and the context check; every failure here is a 4xx."""
        if req.model != s.model_name:
            raise ApiError(404, f"the model {req.model!r} does not exist; this server serves {s.model_name!r}",
                           param="model", code="model_not_found")
        block = req.block_size if req.block_size is not None else s.block_size
        if block is not None and block > top_block:
            raise ApiError(400, f"block_size {block} is out of range: this draft supports 1..{top_block} "
                                "(its training block size)", param="block_size")
        n = req.new_tokens(s.default_max_tokens)
        cfg = runtime.config(max_new_tokens=n, temperature=req.temperature or 0.0,
                             top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                             block_size=block, seed=req.seed)
        prompt = [m.as_dict() for m in req.messages] if chat else req.prompt
        if isinstance(prompt, list) and not chat:  # token ids: checked here, not in the worker after queueing
            vocab = runtime.target.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"prompt token ids must be in [0, {vocab}); got {bad[:3]}", param="prompt")
        try:
            with engine.tokenizer_lock:
                ids = runtime.encode(prompt, chat=chat)
        except DFlashError:
            raise
        except Exception as e:  # e.g. a chat template that refuses this conversation: the input's fault
            raise ApiError(400, f"cannot tokenize the {'messages' if chat else 'prompt'}: {e}",
                           param="messages" if chat else "prompt") from None
        limit = getattr(runtime.target, "max_length", None)
        if limit is not None and len(ids) + n > limit:
            raise ApiError(400, f"request too long: {len(ids)} prompt + {n} new tokens exceeds the model's "
                                f"{limit} positions", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        use_policy = policy if req.block_size is None else None
        return Job(ids, cfg, req.stop_strings(), use_policy, asyncio.get_running_loop())

    async def complete(request: Request, chat: bool) -> Response:
        req = parse(ChatRequest if chat else CompletionRequest, await _read_json(request, s.max_body_bytes))
        try:
            job = prepare(req, chat)
        except DFlashError as e:
            raise ApiError(400, str(e)) from None
        try:
            engine.submit(job)
        except QueueFull:
            raise ApiError(429, f"the server is busy ({engine.pending} requests waiting); retry later",
                           "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(s.retry_after_s)}) from None
        except ShuttingDown as e:
            raise from_exception(e, s.retry_after_s) from None
        watcher = asyncio.create_task(_cancel_on_disconnect(request, engine, job))
        try:
            first = await job.updates.get()
            if isinstance(first, Failed):
                raise from_exception(first.error, s.retry_after_s)
            fmt = Format(chat, s.model_name)
            if req.stream:
                await _stop_task(watcher)
                return _JobStream(_sse(job, fmt, first, req.include_usage, s.retry_after_s), engine, job,
                                  media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            texts: list[str] = []
            update: Update = first
            while not isinstance(update, Finished):
                if isinstance(update, Failed):
                    raise from_exception(update.error, s.retry_after_s)
                texts.append(update.text)
                update = await job.updates.get()
            return JSONResponse(fmt.body("".join(texts), update.reason, update.stats))
        except BaseException:
            engine.cancel(job)
            raise
        finally:
            await _stop_task(watcher)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": s.model_name, "object": "model", "created": started,
                                            "owned_by": "dflash-robot"}]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": s.model_name, "queue_depth": engine.pending}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes (checked while reading), 400 if malformed."""
    too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # bad UTF-8 included; RecursionError: nested too deep
        raise ApiError(400, "the request body is not valid JSON (or is nested too deeply)") from None


async def _cancel_on_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """While a request waits for its (first) tokens: cancel it if the client goes away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.cancel(job)
            return


async def _stop_task(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.wait([task])


async def _sse(job: Job, fmt: Format, update: Update, include_usage: bool, retry_after_s: int) -> AsyncIterator[str]:
    start = fmt.start()
    if start:
        yield start
    while True:
        if isinstance(update, Delta):
            if update.text:
                yield fmt.delta(update.text)
        elif isinstance(update, Finished):
            yield fmt.end(update.reason, update.stats, include_usage)
            return
        else:  # failed after the stream began: an error event, then the end of the stream
            yield sse(from_exception(update.error, retry_after_s).body()) + DONE
            return
        update = await job.updates.get()


class _JobStream(StreamingResponse):
    """A stream that cancels its job however it ends (finished, client gone, shutdown)."""

    def __init__(self, content: AsyncIterator[str], engine: Engine, job: Job, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.engine, self.job = engine, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.cancel(self.job)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return ApiError(e.status_code, str(e.detail), kind, code=code, headers=dict(e.headers or {})).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        return ApiError(400, str(e.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        log.error("internal error", exc_info=e)
        return from_exception(e).response()
