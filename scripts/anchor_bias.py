"""Where decoding starts its blocks, against where training starts them (docs/TRAINING.md, session 10).

Usage: python scripts/anchor_bias.py [--drafts shipped,experiments/smollm2-5layer] [--block-size 16]
                                     [--data data/smollm2-selfdistill] [--training-samples 48] [--threads 2]

Training draws block anchors uniformly over the response (`objective.sample_anchors`). Greedy chain
decoding starts a block only where the previous one missed (a + run + 1). On the held-out samples
of `train` (the stages' fixed 48), this computes each draft's run at every response position
(teacher-forced features from the data's feature store, as the held-out replay does) and reports,
over all positions and over the positions the chain walk visits:
- the mean tokens gained per block (run + 1, no credit past the response);
- the share of blocks whose first drafted token is right.
The gap between the two is what the uniform draw hides: the held-out `tau_est` of the logs is the
uniform figure, the chain replay (`holdout_tau_chain`) the decoding one. The same figures on
training samples (every 100th) show how much of what the draft does there it has memorised.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training.data import FeatureStore, iter_samples
from dflash_robot.training.run import TrainRun, split_holdout
from dflash_robot.training.trainer import DraftTrainer, OptimConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafts", default="shipped,experiments/smollm2-5layer")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--training-samples", type=int, default=48,
                    help="also this many training samples (every 100th), to compare with the held-out ones")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = TrainRun(data=args.data, out="unused")
    hold, train = split_holdout(iter_samples(args.data, run.max_len), run)
    sets = {"held-out": hold, "training": train[::100][:args.training_samples]}
    model, _ = load_target_model(default_target_path(), None, "float32", "cpu")
    for name in args.drafts.split(","):
        draft = load_draft(SHIPPED_DRAFT if name == "shipped" else name)
        store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
        tr = DraftTrainer(model, draft, OptimConfig(bf16_autocast=True), store=store)
        for set_name, samples in sets.items():
            if samples:
                report(tr, name, set_name, samples, args.block_size)


def report(tr: DraftTrainer, name: str, set_name: str, samples: list, block_size: int) -> None:
    every: list[tuple[int, int]] = []  # (gain, first token right) per position
    chain: list[tuple[int, int]] = []
    for ids, mask, key in samples:
        out = tr.response_runs(ids, mask, key, block_size=block_size)
        if out is None:
            continue
        runs, first = out
        n = runs.shape[0]
        row = {a: (min(int(runs[a]) + 1, n - 1 - a), int(runs[a] > 0)) for a in range(first, n - 1)}
        every += row.values()
        a = first
        while a < n - 1:
            chain.append(row[a])
            a += row[a][0]
    for label, rows in (("every response position", every), ("positions the chain visits", chain)):
        print(f"{name}, block {block_size}, {len(samples)} {set_name} samples, {label} ({len(rows)} blocks): "
              f"tokens per block {statistics.mean(g for g, _ in rows):.3f}, first drafted token right "
              f"{statistics.mean(f for _, f in rows):.3f}")


if __name__ == "__main__":
    main()
