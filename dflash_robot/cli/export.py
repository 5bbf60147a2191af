"""`dflash-robot export executorch`: the target and its draft as two ExecuTorch programs.

    dflash-robot export executorch --out smollm2-et                 # the default target and draft
    dflash-robot generate "Hi" --engine executorch --target smollm2-et
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from dflash_robot.cli.common import HelpFormatter, add_model_args, check_paths, draft_training_block_size, int_at_least

DESCRIPTION = """Export a target and its DFlash draft to ExecuTorch (the RFC's two-program design):
target.pte (tokens, input_pos) -> (logits, tapped features) and draft.pte (tokens, features,
features length, input_pos) -> draft logits, each with a position-indexed KV cache inside, so
a rollback is just the next input_pos. Shapes are static: one block size and a maximum
context, fixed here. Lowered with torch.export and the XNNPACK backend (portable kernels for
what XNNPACK does not take); weights are fp32. Run it with `generate --engine executorch
--target OUT` or `bench --engine executorch --target OUT`. Needs the optional extra:
pip install 'dflash-robot[executorch]'."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="export a target and draft to an edge runtime (ExecuTorch)",
                       description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("runtime", choices=["executorch"], help="the edge runtime to export for")
    add_model_args(p, engine=False)
    p.add_argument("--out", required=True, help="output directory (target.pte, draft.pte, manifest.json, tokenizer)")
    p.add_argument("--block-size", type=int_at_least(2), default=None,
                   help="the block size the programs run (default: the draft's own default block size)")
    p.add_argument("--max-context", type=int_at_least(4), default=1024,
                   help="positions the KV caches hold (prompt + generated tokens + block size - 1)")
    p.add_argument("--backend", choices=["xnnpack", "portable"], default="xnnpack",
                   help="xnnpack delegates the linear algebra; portable runs everything on reference kernels")


def run(args: argparse.Namespace) -> int:
    from dflash_robot.errors import ConfigError
    from dflash_robot.export.manifest import require_executorch

    check_paths(args)
    if args.dtype != "float32":
        raise ConfigError("the export computes in float32; drop --dtype")
    if args.device != "cpu":
        raise ConfigError("the export runs on ExecuTorch's CPU backends; drop --device")
    top = draft_training_block_size(args.draft)
    if args.block_size is not None and args.block_size > top:
        raise ConfigError(f"--block-size {args.block_size} is out of range: this draft supports 2..{top}")
    if args.max_context < 2 * (args.block_size or top):
        raise ConfigError(f"--max-context {args.max_context} must be at least twice the block size "
                          f"({args.block_size or top}{'' if args.block_size else ', the largest this draft runs'})")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").is_file():
        raise ConfigError(f"--out {out} is a non-empty directory that is not an export; choose another")
    require_executorch()
    import torch

    from dflash_robot.export.executorch import export_executorch
    from dflash_robot.runtime.api import DFlashRuntime

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    print("loading the target and draft ...", file=sys.stderr, flush=True)
    rt = DFlashRuntime.load(args.target, args.draft, gguf_file=args.gguf_file, dtype="float32", device="cpu",
                            fast_linears=False, engine="hf")
    assert rt.draft is not None
    manifest = export_executorch(rt.target.model, rt.draft, out, block_size=args.block_size,  # type: ignore[attr-defined]
                                 max_context=args.max_context, tokenizer=rt.tokenizer, backend=args.backend,
                                 stop_token_ids=rt.stop_token_ids(),
                                 progress=lambda s: print(s, file=sys.stderr, flush=True))
    sizes = ", ".join(f"{k}.pte {v / 2**20:.1f} MiB" for k, v in manifest["pte_bytes"].items())
    print(f"wrote {out} ({sizes}; block size {manifest['block_size']}, max context {manifest['max_context']}) "
          f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return 0
