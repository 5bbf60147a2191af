"""How far can a draft's chain acceptance go on samples it has memorised? A capacity check.

Usage: python scripts/memorise.py [--draft shipped] [--shards shard-00288,shard-00289] [--samples 64]
                                  [--steps 400] [--lr 3e-4] [--threads 2]

Continues the draft on `--samples` samples of the given shards only (batches of 4, cycling), and
replays greedy chain decoding (`DraftTrainer.chain_acceptance`, what `train` logs as
`holdout_tau_chain`) on those same samples before and during training. If the draft cannot get
high acceptance even on text it has seen many times, depth, features or objective cap it; if it
can, what held-out acceptance lacks is generalisation (data and optimisation). Nothing is saved.
docs/TRAINING.md, session 11, quotes it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.targets.fastpath import pack_linears
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training.data import FeatureStore, iter_samples
from dflash_robot.training.run import holdout_chain
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

SHIPPED = "dflash_robot/drafts/smollm2-135m-instruct"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default="shipped")
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--shards", default="shard-00288", help="comma-separated shard names (never trained on: 288+)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target_model(default_target_path(), None, "float32", "cpu")
    pack_linears(model)
    draft = load_draft(SHIPPED if args.draft == "shipped" else args.draft).float()
    names = set(args.shards.split(","))
    samples = [s for s in iter_samples(args.data) if s[2][0] in names][:args.samples]
    if not samples:
        raise SystemExit(f"no samples in {sorted(names)} under {args.data}")
    store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
    cfg = OptimConfig(lr=args.lr, warmup_steps=20, total_steps=args.steps, blocks_per_seq=32, bf16_autocast=True)
    tr = DraftTrainer(model, draft, cfg, store=store)

    def report(step: int, loss: float | None) -> None:
        print(json.dumps({"draft": args.draft, "shards": args.shards, "samples": len(samples), "step": step,
                          "loss": loss, "chain_tau_b16": round(holdout_chain(tr, samples), 3),
                          "chain_tau_b4": round(holdout_chain(tr, samples, 4), 3)}), flush=True)

    report(0, None)
    for k in range(args.steps):
        batch = [samples[(4 * k + j) % len(samples)] for j in range(4)]
        stats = tr.train_step([(s[0], s[1]) for s in batch], keys=[s[2] for s in batch])
        if (k + 1) % max(1, args.steps // 4) == 0:
            report(k + 1, round(stats["loss"], 3))


if __name__ == "__main__":
    main()
