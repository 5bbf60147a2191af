"""Two checks of the self-distillation data behind the held-out figures (docs/TRAINING.md).

Usage: python scripts/check_labels.py [--data data/smollm2-selfdistill] [--draft PATH] [--threads 2]

1. Labels: on the held-out samples, the share of response tokens that equal the target's own
   greedy choice under teacher forcing (one forward over the whole sample), with the target in
   fp32 and in bf16, and as `generate` executes it (the default lean engine on the GGUF's own
   Q4_1 weights). The data was generated batched in bf16; a low share would mean the draft learns
   a function the target as executed does not compute.
2. Held-out prompts in training: held-out samples whose prompt also occurs among the training
   shards (the prompt pools are finite), which `train` now leaves out of training; and the
   draft's chain-replay tau on the held-out set with and without those samples.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training.data import FeatureStore, iter_samples
from dflash_robot.training.run import TrainRun, holdout_chain, prompt_key, split_holdout
from dflash_robot.training.trainer import DraftTrainer, OptimConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--draft", default=str(SHIPPED_DRAFT))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run = TrainRun(data=args.data, out="unused")
    samples = iter_samples(args.data, run.max_len)
    hold, _ = split_holdout(samples, run)
    held = {s[2] for s in hold}
    train_prompts = {prompt_key(s) for s in samples if s[2] not in held}  # all, repeats included
    for dtype in ("bfloat16", "float32"):  # the fp32 target stays loaded for the replay below
        model, _ = load_target_model(default_target_path(), None, dtype, "cpu")
        same = total = 0
        with torch.no_grad():
            for ids, mask, _key in hold:
                pred = model(input_ids=ids[None]).logits[0, :-1].argmax(-1)
                same += int(((pred == ids[1:]) & mask[1:]).sum())
                total += int(mask[1:].sum())
        print(f"labels: target {dtype} teacher-forced greedy == data token on {same}/{total} held-out "
              f"response tokens ({same / total:.4f})")
    from dflash_robot.runtime.api import DFlashRuntime

    engine = DFlashRuntime.load(None, None, no_draft=True).target  # what `generate` runs by default
    same = total = 0
    for ids, mask, _key in hold:
        engine.reset()
        pred = engine.verify(ids, None).logits[:-1].argmax(-1)
        same += int(((pred == ids[1:]) & mask[1:]).sum())
        total += int(mask[1:].sum())
    print(f"labels: default engine ({type(engine).__name__}) teacher-forced greedy == data token on "
          f"{same}/{total} held-out response tokens ({same / total:.4f})")
    del engine
    dup = [s for s in hold if prompt_key(s) in train_prompts]
    print(f"held-out samples whose prompt occurs in a training shard: {len(dup)} of {len(hold)} "
          f"({sum(int(s[1].sum()) for s in dup)} of {sum(int(s[1].sum()) for s in hold)} response tokens)")
    draft = load_draft(args.draft)
    store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
    tr = DraftTrainer(model, draft, OptimConfig(bf16_autocast=True), store=store)
    clean = [s for s in hold if prompt_key(s) not in train_prompts]
    print(f"chain tau of {args.draft}: all {len(hold)} held-out {holdout_chain(tr, hold):.3f}, "
          f"without them ({len(clean)}) {holdout_chain(tr, clean):.3f}")


if __name__ == "__main__":
    main()
