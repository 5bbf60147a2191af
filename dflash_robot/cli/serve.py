"""`dflash-robot serve`: an OpenAI-compatible HTTP server (see docs/SERVING.md)."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from dflash_robot.cli.common import (
    HelpFormatter,
    add_decoding_args,
    add_model_args,
    check_block_size,
    check_paths,
    cost_progress,
    int_at_least,
    load_runtime,
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
    add_decoding_args(d, per_request=True)
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
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError("--api-key is empty")
    if args.model_name is not None and not args.model_name.strip():
        raise ConfigError("--model-name is empty")
    check_paths(args)
    check_block_size(args)
    try:  # last: a taken port or a bad address fails now, not after the model has loaded
        family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        with socket.create_server((args.host, args.port), family=family):  # IPv4 or IPv6, as uvicorn will
            pass
    except OSError as e:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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

    from dflash_robot.serve import ServeSettings, create_app

    if not _is_loopback(args.host) and args.api_key is None:
        print(f"dflash-robot: warning: listening on {args.host} without --api-key", file=sys.stderr)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print("loading the target and draft ...", file=sys.stderr, flush=True)
    rt = load_runtime(args)
    if args.adaptive:
        rt.adaptive_policy(args.cost_cache or None, progress=cost_progress)  # measure now, not in a request
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
