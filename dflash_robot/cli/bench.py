"""`dflash-robot bench`: acceptance and speed on offline prompt sets, side by side."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from dflash_robot.cli.common import (
    DEFAULT_COST_CACHE,
    HelpFormatter,
    add_model_args,
    check_paths,
    int_at_least,
    int_list,
    load_runtime,
)

DESCRIPTION = """Measure DFlash against plain decoding on offline prompt sets, in one process.

For every prompt: the autoregressive baseline (the same loop at block size 1), every block
size of the sweep and the adaptive policy (greedy outputs checked token-equal to the
baseline), and optionally transformers' generate and llama.cpp on the same model.
Writes bench.json, bench.md and PNG plots to --out.

example:
  dflash-robot bench --datasets humaneval,gsm8k --limit 10 --block-sizes 2,4,8,16 --hf-generate --llama-cpp
"""


def add_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="measure acceptance and speed-ups on offline prompt sets",
                       description=DESCRIPTION, formatter_class=HelpFormatter)
    add_model_args(b)
    b.add_argument("--datasets", default="humaneval,gsm8k",
                   help="comma-separated: humaneval, gsm8k, aime25, mtbench (both turns), ifbench")
    b.add_argument("--limit", type=int_at_least(1), default=10, help="prompts per dataset (a seeded subset)")
    b.add_argument("--block-sizes", type=int_list, default=[2, 4, 8, 16], help="fixed block sizes to sweep")
    b.add_argument("--tree-budgets", type=int_list, default=[],
                   help="also run tree verification (DDTree) with these node budgets, e.g. 8,16,32")
    b.add_argument("--tree-block-size", type=int_at_least(2), default=None,
                   help="block size (tree depth + 1) of the tree runs (default: budget + 1, at most the draft's "
                        "training block size: deep enough for the budget as one chain)")
    b.add_argument("--lookup", type=int_list, default=[],
                   help="also run each block size (and adaptive) with an n-gram lookup branch of up to this many "
                        "tokens, e.g. 7 (rows 'q=4+lookup=7'; docs/ARCHITECTURE.md, 'N-gram lookup')")
    b.add_argument("--no-adaptive", action="store_true", help="skip the adaptive block-size policy")
    b.add_argument("--max-new-tokens", type=int_at_least(1), default=128, help="tokens to generate per prompt")
    b.add_argument("--seed", type=int, default=0, help="subset selection seed")
    b.add_argument("--hf-generate", action="store_true", help="also time transformers' generate on the target")
    b.add_argument("--llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python) on a GGUF; default: the target's own GGUF")
    b.add_argument("--rollback", choices=["replay", "capture"], default=None, help="hybrid targets only")
    b.add_argument("--cost-cache", default=DEFAULT_COST_CACHE,
                   help="JSON file caching the measured iteration-cost curve ('' to always re-measure)")
    b.add_argument("--out", default="bench-results", help="output directory")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from dflash_robot.bench.runner import DATASETS, conversations
    from dflash_robot.errors import ConfigError

    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    for d in datasets:
        if d not in DATASETS:
            raise ConfigError(f"unknown dataset {d!r}; choose from {', '.join(DATASETS)}")
    if not args.block_sizes or any(q < 1 for q in args.block_sizes):
        raise ConfigError(f"--block-sizes must be integers >= 1, got {args.block_sizes}")
    if any(n < 1 for n in args.tree_budgets):
        raise ConfigError(f"--tree-budgets must be integers >= 1, got {args.tree_budgets}")
    if args.tree_block_size is not None and not args.tree_budgets:
        raise ConfigError("--tree-block-size needs --tree-budgets")
    from dflash_robot.runtime.config import MAX_LOOKUP_TOKENS

    if any(not 1 <= n <= MAX_LOOKUP_TOKENS for n in args.lookup):
        raise ConfigError(f"--lookup must be integers in 1..{MAX_LOOKUP_TOKENS}, got {args.lookup}")
    if args.hf_generate and args.engine == "executorch":
        raise ConfigError("--hf-generate runs transformers' generate on the target model, which an ExecuTorch "
                          "export does not hold; bench the export without it, or the eager target with it")
    check_paths(args)
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:  # not after the whole run
        raise ConfigError("plots need matplotlib: `pip install 'dflash-robot[bench]'` (or pass --no-plots)")
    from dflash_robot.drafts.checkpoint import ensure_writable_dir
    from dflash_robot.targets.loading import default_target_path

    out = Path(args.out)
    ensure_writable_dir(out)
    for d in datasets:  # fail before loading anything if a dataset's package is missing
        conversations(d, 1, args.seed)
    target = Path(args.target) if args.target else default_target_path()
    gguf = None
    if args.llama_cpp == "auto":
        gguf = target if target.suffix == ".gguf" else (target / args.gguf_file if args.gguf_file else None)
        if gguf is None:
            raise ConfigError("--llama-cpp needs a GGUF: pass its path, or use a .gguf target")
    elif args.llama_cpp:
        gguf = Path(args.llama_cpp)
    if gguf is not None and not gguf.is_file():
        raise ConfigError(f"GGUF file {gguf} does not exist")
    return _run(args, datasets, target, gguf, out)


def _run(args: argparse.Namespace, datasets: list[str], target: Path, gguf: Path | None, out: Path) -> int:
    import torch

    from dflash_robot.bench.runner import BenchConfig, run_bench, write_outputs
    from dflash_robot.errors import ConfigError
    from dflash_robot.runtime.api import DEFAULT_DRAFT

    if args.threads:
        torch.set_num_threads(args.threads)
    rt = load_runtime(args, target=target)
    assert rt.draft is not None
    reason = getattr(rt.target, "tree_unsupported", None)
    if args.tree_budgets and reason is not None:
        raise ConfigError(f"--tree-budgets: {reason}")
    if args.lookup and reason is not None:
        raise ConfigError(f"--lookup (its branch is verified as a tree): {reason}")
    top = rt.draft.metadata.training_block_size
    if any(q > top for q in args.block_sizes + [args.tree_block_size or 0]):
        raise ConfigError(f"--block-sizes {args.block_sizes} / --tree-block-size {args.tree_block_size}: "
                          f"this draft supports 1..{top}")
    cfg = BenchConfig(datasets=datasets, limit=args.limit, block_sizes=args.block_sizes,
                      adaptive=not args.no_adaptive, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      hf_generate=args.hf_generate, llama_cpp_gguf=str(gguf) if gguf else None,
                      threads=args.threads, progress=not args.no_progress, tree_budgets=args.tree_budgets,
                      tree_block_size=args.tree_block_size, lookup_tokens=args.lookup)
    costs = tree_costs = None
    if cfg.adaptive:
        print("iteration-cost curve for --adaptive (cached: " + (args.cost_cache or "off") + ")", file=sys.stderr)
        costs = rt.adaptive_policy(args.cost_cache or None).costs
        if args.tree_budgets:  # `adaptive+tree`: budget n's arm runs at block size min(top, n + 1)
            tree_costs = rt.adaptive_policy(args.cost_cache or None, tree_budgets=args.tree_budgets).tree_costs
    draft_name = "draft.pte in the export" if args.engine == "executorch" else \
        str(args.draft or "shipped (" + DEFAULT_DRAFT.name + ")")
    meta = {"target": str(target), "draft": draft_name,
            "dtype": args.dtype, "device": args.device, "fast_linears": not args.no_fast_linears,
            "engine": type(rt.target).__name__, "precision": rt.info.get("precision"),
            "kernels": rt.info.get("kernels"),
            "command": "dflash-robot " + " ".join(sys.argv[1:])}
    report = run_bench(rt, cfg, costs, meta, tree_costs)
    paths = write_outputs(report, out, plots=not args.no_plots)
    print((out / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0
