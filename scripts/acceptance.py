"""Acceptance length and speed of a draft on held-out prompts, against block size 1 in the same run.

Usage: python scripts/acceptance.py --dataset humaneval --limit 10 --block-size 16 [--draft DIR]
Each prompt runs DFlash at --block-size and the same loop at block size 1 (the autoregressive
baseline: same engine, same dtype), greedy, one after the other in this process.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import time

import torch

from dflash_robot.bench.datasets import formatted_prompts
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load(draft=args.draft, dtype=args.dtype)
    tok = rt.tokenizer
    eos = (tok.eos_token_id,)
    acc: list[int] = []
    dfl_tok = dfl_s = ar_tok = ar_s = 0.0
    for text in formatted_prompts(args.dataset, args.limit):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]
        r = rt.orchestrator.generate(ids, GenerationConfig(args.max_new_tokens, args.block_size, stop_token_ids=eos))
        acc += r.acceptance_lengths
        dfl_tok += len(r.token_ids) - 1
        dfl_s += r.decode_s
        if not args.no_baseline:
            b = rt.orchestrator.generate(ids, GenerationConfig(args.max_new_tokens, 1, stop_token_ids=eos))
            assert b.token_ids == r.token_ids, "lossless check failed"
            ar_tok += len(b.token_ids) - 1
            ar_s += b.decode_s
    hist = collections.Counter(acc)
    out = {
        "dataset": args.dataset, "prompts": args.limit, "block_size": args.block_size, "dtype": args.dtype,
        "mean_acceptance_length": sum(acc) / len(acc),
        "histogram": {k: hist[k] for k in sorted(hist)},
        "dflash_tokens_per_s": dfl_tok / dfl_s,
        "baseline_tokens_per_s": ar_tok / ar_s if ar_s else None,
        "speedup": (dfl_tok / dfl_s) / (ar_tok / ar_s) if ar_s else None,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
