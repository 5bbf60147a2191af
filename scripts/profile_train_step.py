"""The cost of a training step over many steps: median seconds a step, the process's anonymous
memory and its minor page faults, every `--every` steps.

Usage: python scripts/profile_train_step.py [--shards 400-570] [--steps 80] [--shape-quantum 64]
                                            [--draft experiments/smollm2-5layer] [--threads 2]
                                            [--torch-profile N]

The trainer of `dflash-robot train` (bf16 autocast, batch 4, 32 blocks a sequence, lr 1e-4) on the
default target, continuing `--draft`, on the committed data's cached features for `--shards`.
`--shape-quantum 1` turns off the padding of sequence shapes (`DraftTrainer.shape_quantum`), which
is how steps ran before session 14: run with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 or =16384 to see
what oneDNN's kernel cache does to it. docs/TRAINING.md (session 14) quotes it.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.runtime.api import runtime_target_adapter
from dflash_robot.targets.fastpath import pack_linears
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training import run as R
from dflash_robot.training.data import FeatureStore, iter_samples
from dflash_robot.training.trainer import DraftTrainer, OptimConfig


def anonymous_mb() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) // 1024
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--shards", default="400-570")
    ap.add_argument("--draft", default="experiments/smollm2-5layer")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--shape-quantum", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="after --steps, profile N more steps with torch.profiler and print where their time went")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    src = load_draft(args.draft)  # its depth and taps: the run continues it unchanged
    run = R.TrainRun(out="unused", data=args.data, init=f"draft:{args.draft}", train_shards=args.shards,
                     layers=len(src.layers), target_layers=",".join(map(str, src.metadata.target_layer_ids)))
    chosen = R.shard_selection(args.shards)
    samples = [s for s in iter_samples(Path(args.data), run.max_len) if chosen(s[2][0])]
    model, tok = load_target_model(default_target_path(), None, "float32", "cpu")
    pack_linears(model)
    draft, _ = R._make_draft(run, model, tok, samples)
    # features first: the store lists the tap sets that exist when it is made (as `run.train` does)
    R.ensure_features(lambda: runtime_target_adapter(model, str(default_target_path())), Path(args.data),
                      draft.metadata.target_layer_ids, only={s[2][0] for s in samples})
    store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
    cfg = OptimConfig(lr=1e-4, warmup_steps=50, total_steps=3000, blocks_per_seq=32, bf16_autocast=True)
    trainer = DraftTrainer(model, draft, cfg, store=store)
    trainer.shape_quantum = args.shape_quantum
    times: list[float] = []
    for step in range(args.steps):
        batch = [samples[i] for i in R.batch_indices(step, len(samples), 4, 0, 0, 1)]
        t0 = time.perf_counter()
        trainer.train_step([(s[0], s[1]) for s in batch], keys=[s[2] for s in batch])
        times.append(time.perf_counter() - t0)
        if (step + 1) % args.every == 0:
            print(f"steps {step + 2 - args.every}-{step + 1}: median {statistics.median(times):.2f} s a step, "
                  f"anonymous memory {anonymous_mb()} MB, minor faults so far "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_minflt}", flush=True)
            times = []
    if args.torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(args.steps, args.steps + args.torch_profile):
                batch = [samples[i] for i in R.batch_indices(step, len(samples), 4, 0, 0, 1)]
                trainer.train_step([(s[0], s[1]) for s in batch], keys=[s[2] for s in batch])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


if __name__ == "__main__":
    main()
