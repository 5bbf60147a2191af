"""`dflash-robot serve`: an OpenAI-compatible HTTP server (see docs/SERVING.md)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import sys
import time
from pathlib import Path
from typing import Any

from dflash_robot.cli.common import (
    DEFAULT_COST_CACHE,
    HelpFormatter,
    add_model_args,
    check_paths,
    draft_training_block_size,
    int_at_least,
)

DESCRIPTION = """Serve the target with DFlash speculative decoding over an OpenAI-compatible HTTP API.

Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), GET /v1/models,
GET /health, GET /metrics (Prometheus). One request runs at a time, the others wait in a
FIFO queue (--max-queue); each answer carries its speculative statistics in "dflash".
Needs the serve extra: pip install 'dflash-robot[serve]'.

examples:
  dflash-robot serve                                  # SmolLM2-135M-Instruct on 127.0.0.1:8000
  dflash-robot serve --port 9000 --api-key "$KEY" --max-queue 32
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}]}'
"""

API_KEY_ENV = "DFLASH_ROBOT_API_KEY"


def add_parser(sub: Any) -> None:
    g = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API", description=DESCRIPTION,
                       formatter_class=HelpFormatter)
    add_model_args(g)
    d = g.add_argument_group("decoding")
    d.add_argument("--block-size", type=int_at_least(1),
                   help="default tokens verified per step, 1..the draft's training block size (requests may "
                        "set their own 'block_size'); None: the draft's own default")
    d.add_argument("--adaptive", action="store_true",
                   help="requests without 'block_size' get an adaptive block size (the cost curve is measured "
                        "once at startup, then cached; see --cost-cache)")
    d.add_argument("--cost-cache", default=DEFAULT_COST_CACHE,
                   help="JSON file caching the iteration-cost curve ('' to re-measure)")
    d.add_argument("--rollback", choices=["replay", "capture"], default=None,
                   help="rollback of hybrid (linear-attention/SSM) targets; None: capture where possible")
    d.add_argument("--default-max-tokens", type=int_at_least(1), default=128,
                   help="new tokens for requests that set neither max_tokens nor max_completion_tokens")
    h = g.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    h.add_argument("--port", type=int_at_least(0), default=8000, help="TCP port (0: any free port)")
    h.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 endpoints; when omitted, "
                                      f"${API_KEY_ENV} is used if set (none: no key needed)")
    h.add_argument("--max-queue", type=int_at_least(0), default=16,
                   help="requests that may wait behind the running one; more get 429 with Retry-After")
    h.add_argument("--max-body-bytes", type=int_at_least(1), default=1 << 20,
                   help="larger request bodies get 413")
    h.add_argument("--model-name", help="the served model id; None: the target's directory or GGUF file name")
    h.add_argument("--shutdown-timeout", type=int_at_least(0), default=30,
                   help="seconds SIGTERM/Ctrl-C waits for running requests before cancelling them")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")


def _validate(args: argparse.Namespace) -> None:
    """Everything that can be checked without loading a model."""
    from dflash_robot.errors import ConfigError

    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"serve needs {', '.join(missing)}: pip install 'dflash-robot[serve]'")
    if args.port > 65535:
        raise ConfigError(f"--port {args.port} is out of range: 0..65535")
    if args.adaptive and args.block_size is not None:
        raise ConfigError("--adaptive chooses the block size itself; drop --block-size")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty")
    if args.model_name is not None and not args.model_name.strip():
        raise ConfigError("--model-name is empty")
    check_paths(args)
    if args.block_size is not None and args.block_size > 1:
        top = draft_training_block_size(args.draft)
        if args.block_size > top:
            raise ConfigError(f"--block-size {args.block_size} is out of range: this draft supports 1..{top} "
                              "(its training block size)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cost_progress(done: int, total: int) -> None:
    print(f"\rmeasuring the iteration-cost curve for --adaptive: round {done}/{total} ...", end="",
          file=sys.stderr, flush=True)


def model_name(target: str | None, gguf_file: str | None) -> str:
    """The served id: the GGUF file's stem, else the target's directory name."""
    if gguf_file:
        return Path(gguf_file).stem
    if target:
        p = Path(target)
        return p.stem if p.suffix == ".gguf" else p.resolve().name
    return "SmolLM2-135M-Instruct"


def run(args: argparse.Namespace) -> int:
    _validate(args)
    import torch
    import uvicorn

    from dflash_robot.runtime.api import DFlashRuntime
    from dflash_robot.serve import ServeSettings, create_app

    if not _is_loopback(args.host) and args.api_key is None:
        print(f"dflash-robot: warning: listening on {args.host} without --api-key", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print("loading the target and draft ...", file=sys.stderr, flush=True)
    # model options that `add_model_args` may offer (precision, draft placement): passed when given
    extra = {k: getattr(args, k) for k in ("precision", "draft_device", "draft_dtype")
             if getattr(args, k, None) is not None}
    rt = DFlashRuntime.load(args.target, args.draft, gguf_file=args.gguf_file, dtype=args.dtype,
                            device=args.device, rollback=args.rollback, fast_linears=not args.no_fast_linears,
                            engine=args.engine, **extra)
    if args.adaptive:
        rt.adaptive_policy(args.cost_cache or None, progress=_cost_progress)  # measure now, not in a request
        print(file=sys.stderr)
    settings = ServeSettings(model_name=args.model_name or model_name(args.target, args.gguf_file),
                             api_key=args.api_key, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                             block_size=args.block_size, adaptive=args.adaptive, cost_cache=args.cost_cache or None,
                             default_max_tokens=args.default_max_tokens)
    app = create_app(rt, settings)
    print(f"loaded in {time.perf_counter() - t0:.1f} s; serving {settings.model_name!r} on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
    return 0
