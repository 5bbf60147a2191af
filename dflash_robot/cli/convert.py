"""`dflash-robot convert SRC DST`: a z-lab draft directory <-> a one-file GGUF draft.

    dflash-robot convert runs/my-draft/draft my-draft.gguf --outtype q8_0
    dflash-robot convert my-draft.gguf runs/my-draft-again
    dflash-robot convert dflash_robot/drafts/smollm2-135m-instruct smollm2-draft.gguf --tokenizer-from default
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from dflash_robot.cli.common import HelpFormatter

DESCRIPTION = """Convert a DFlash draft between z-lab's checkpoint directory (config.json +
model.safetensors) and a single GGUF file in llama.cpp's `dflash` schema (docs/DRAFT_FORMAT.md).
The direction comes from the paths: a directory SRC is written to DST.gguf; a .gguf SRC is
written to the directory DST. A .gguf draft also loads directly: --draft my-draft.gguf."""

OUTTYPE_HELP = """storage type. To GGUF: f32, f16, bf16 or q8_0 (1-D norm tensors stay f32, as in
llama.cpp); auto = the draft's own dtype (lossless). To a directory: f32, f16 or bf16; auto = the
dtype the GGUF was exported from"""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a draft between a z-lab directory and a GGUF file",
                       description=DESCRIPTION, formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="draft directory or .gguf file")
    p.add_argument("dst", metavar="DST", help=".gguf file (from a directory) or directory (from a .gguf)")
    p.add_argument("--outtype", default="auto", choices=["auto", "f32", "f16", "bf16", "q8_0"], help=OUTTYPE_HELP)
    p.add_argument("--tokenizer-from", metavar="TARGET.gguf",
                   help="to GGUF: copy the target's tokenizer (its tokenizer.ggml.* keys) into the file, which "
                        "llama.cpp needs to load it; 'default' = the default SmolLM2 target's GGUF. The draft's "
                        "vocabulary must match it")


def _to_gguf(src: Path, dst: Path) -> bool:
    """True to write a GGUF, False to write a directory; ConfigError when the paths do not say."""
    from dflash_robot.errors import ConfigError

    if not src.exists():
        raise ConfigError(f"SRC {src} does not exist")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConfigError(f"SRC and DST are the same path ({src})")
    is_gguf = dst.suffix.lower() == ".gguf"
    if src.is_dir():
        if not is_gguf:
            raise ConfigError(f"DST {dst} must be a .gguf file when SRC is a draft directory")
        if dst.is_dir():
            raise ConfigError(f"DST {dst} is a directory; give a .gguf file name")
        return True
    if src.suffix.lower() != ".gguf":
        raise ConfigError(f"SRC {src} is neither a draft directory nor a .gguf file")
    if is_gguf or dst.is_file():
        raise ConfigError(f"DST {dst} must be a directory when SRC is a .gguf file")
    if dst.is_dir() and any(dst.iterdir()):  # never write over a draft (or anything) already there
        raise ConfigError(f"DST {dst} exists and is not empty; remove it or give a new directory")
    return False


def run(args: argparse.Namespace) -> int:
    src, dst = Path(args.src), Path(args.dst)
    to_gguf = _to_gguf(src, dst)
    from dflash_robot.errors import ConfigError

    if not to_gguf and args.outtype == "q8_0":
        raise ConfigError("--outtype q8_0 is a GGUF storage type; a draft directory takes f32, f16 or bf16")
    tok = args.tokenizer_from
    if tok is not None:
        if not to_gguf:
            raise ConfigError("--tokenizer-from applies when writing a GGUF file (SRC a draft directory)")
        if tok == "default":
            from dflash_robot.targets.loading import default_target_path

            tok = default_target_path()
        if not Path(tok).is_file():
            raise ConfigError(f"--tokenizer-from {tok} is not a file")
    import torch

    from dflash_robot.drafts.checkpoint import load_draft, save_draft
    from dflash_robot.drafts.gguf import load_gguf_draft, save_gguf_draft

    if to_gguf:
        draft = load_draft(src)
        save_gguf_draft(draft, dst, args.outtype, tokenizer_from=tok)
        what = f"{args.outtype} GGUF" + (" with the target's tokenizer" if tok else "")
    else:
        dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}.get(args.outtype)
        draft = load_gguf_draft(src, dtype=dtype)
        save_draft(draft, dst)
        what = f"{str(draft.fc.weight.dtype).removeprefix('torch.')} draft directory"
    size = dst.stat().st_size if dst.is_file() else sum(f.stat().st_size for f in dst.iterdir())
    print(f"wrote {dst}: {what}, {len(draft.layers)} layers, {size / 2**20:.1f} MiB", file=sys.stderr)
    return 0
