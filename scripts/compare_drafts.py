"""Mean acceptance length and decode speed of several drafts on the bench's prompts, side by side.

Usage: python scripts/compare_drafts.py --drafts shipped,runs/stage6/draft [--datasets humaneval,gsm8k]
                                        [--limit 10] [--block-sizes 1,4,16] [--threads 2] [--repeats 1]
                                        [--temperature 1.0 --seeds 3]

Greedy, 128 new tokens, z-lab's prompt formats with the chat template (`bench.datasets`), the default
target and engine (or sampled at `--temperature`, each prompt once per seed in `--seeds`); τ pooled
over the verify steps of all prompts, as `bench` reports it, and the decode tok/s. "shipped" is the
draft in the package. docs/TRAINING.md quotes it when a draft is considered for shipping.

One target serves every draft (each draft gets its own proposer and orchestrator over it, at the
precision `DFlashRuntime.load` would give it), and the drafts take turns prompt by prompt, the
order rotating from one prompt to the next, so drift on a shared box reaches every draft alike.
Block size 1 is the target alone (no draft): it is run once per prompt, as "autoregressive", in the
same rotation. `--repeats N` runs every prompt N times per draft (tok/s over all of them; greedy
τ does not change).
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_robot.bench.datasets import formatted_prompts
from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.drafts.validation import check_compatible
from dflash_robot.runtime.api import DFlashRuntime, draft_precision
from dflash_robot.runtime.config import GenerationConfig, SamplingConfig
from dflash_robot.runtime.orchestrator import RuntimeOrchestrator
from dflash_robot.runtime.proposer import DFlashProposer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="shipped")
    ap.add_argument("--datasets", default="humaneval,gsm8k")
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--block-sizes", default="4,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every prompt per draft (timing only)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the floor's setting)")
    ap.add_argument("--seeds", type=int, default=1, help="sampled runs per prompt (seeds 0..N-1)")
    args = ap.parse_args()
    sampling = SamplingConfig(temperature=args.temperature)
    seeds = list(range(args.seeds)) if args.temperature > 0 else [None]
    names = args.drafts.split(",")
    block_sizes = [int(x) for x in args.block_sizes.split(",")]
    drafts = {n: None if n == "shipped" else load_draft(n, dtype=torch.float32) for n in names}  # bad paths fail first
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load()
    orchestrators = {}
    for n, d in drafts.items():
        if d is None:
            orchestrators[n] = rt.orchestrator
        else:
            check_compatible(d, rt.target)
            prop = DFlashProposer(d, rt.target.input_embedding_weight(), rt.target.output_head(),
                                  precision=draft_precision(rt.info["precision"]))
            orchestrators[n] = RuntimeOrchestrator(rt.target, prop, rt.orchestrator.prefill_chunk_size)
    eos = rt.stop_token_ids()
    warm = rt.encode(formatted_prompts(args.datasets.split(",")[0], 1)[0])
    for orch in orchestrators.values():  # untimed: first-call allocations and kernel builds
        orch.generate(warm, GenerationConfig(16, max(block_sizes), sampling, stop_token_ids=eos))
    rows = []
    for ds in args.datasets.split(","):
        prompts = [rt.encode(t) for t in formatted_prompts(ds, args.limit)]
        jobs = [(i, s) for i in prompts for s in seeds for _ in range(args.repeats)]
        for q in block_sizes:
            runners = ["autoregressive"] if q == 1 else names
            acc: dict[str, list[int]] = {n: [] for n in runners}
            toks = dict.fromkeys(runners, 0)
            secs = dict.fromkeys(runners, 0.0)
            for k, (ids, seed) in enumerate(jobs):
                for n in runners[k % len(runners):] + runners[:k % len(runners)]:
                    orch = rt.orchestrator if n == "autoregressive" else orchestrators[n]
                    r = orch.generate(ids, GenerationConfig(args.max_new_tokens, q, sampling, stop_token_ids=eos,
                                                            seed=seed))
                    acc[n] += r.acceptance_lengths
                    toks[n] += len(r.token_ids) - 1
                    secs[n] += r.decode_s
            for n in runners:
                rows.append({"draft": n, "dataset": ds, "block_size": q, "temperature": args.temperature,
                             "tau": round(sum(acc[n]) / len(acc[n]), 3), "tok_s": round(toks[n] / secs[n], 1),
                             "repeats": args.repeats})
                print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
