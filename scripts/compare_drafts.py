"""Mean acceptance length of several drafts on the bench's prompts, side by side in one process.

Usage: python scripts/compare_drafts.py --drafts shipped,runs/stage6/draft [--datasets humaneval,gsm8k]
                                        [--limit 10] [--block-sizes 4,16] [--threads 2]
                                        [--temperature 1.0 --seeds 3]

Greedy, 128 new tokens, z-lab's prompt formats with the chat template (`bench.datasets`), the default
target and engine (or sampled at `--temperature`, each prompt once per seed in `--seeds`); τ pooled
over the verify steps of all prompts, as `bench` reports it, and the DFlash decode tok/s. "shipped"
is the draft in the package. docs/TRAINING.md quotes it when a draft is considered for shipping.
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_robot.bench.datasets import formatted_prompts
from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.config import GenerationConfig, SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="shipped")
    ap.add_argument("--datasets", default="humaneval,gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--block-sizes", default="4,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the floor's setting)")
    ap.add_argument("--seeds", type=int, default=1, help="sampled runs per prompt (seeds 0..N-1)")
    args = ap.parse_args()
    sampling = SamplingConfig(temperature=args.temperature)
    seeds = list(range(args.seeds)) if args.temperature > 0 else [None]
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.drafts.split(","):
        rt = DFlashRuntime.load(draft=None if name == "shipped" else name)
        eos = rt.stop_token_ids()
        for ds in args.datasets.split(","):
            prompts = [rt.encode(t) for t in formatted_prompts(ds, args.limit)]
            for q in (int(x) for x in args.block_sizes.split(",")):
                acc: list[int] = []
                toks = secs = 0.0
                for ids, seed in ((i, s) for i in prompts for s in seeds):
                    r = rt.orchestrator.generate(ids, GenerationConfig(args.max_new_tokens, q, sampling,
                                                                       stop_token_ids=eos, seed=seed))
                    acc += r.acceptance_lengths
                    toks += len(r.token_ids) - 1
                    secs += r.decode_s
                rows.append({"draft": name, "dataset": ds, "block_size": q, "temperature": args.temperature,
                             "tau": round(sum(acc) / len(acc), 3),
                             "tok_s": round(toks / secs, 1)})
                print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
