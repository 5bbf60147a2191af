"""How much of the self-distillation data repeats itself, and how well drafts do on what repeats
(docs/TRAINING.md, session 39).

Usage: python scripts/repeats.py [--data data/smollm2-selfdistill]
       python scripts/repeats.py --drafts shipped,runs/stage33/draft --shards 1625-1744 --every 16 [--threads 2]

Without `--drafts`, it counts, per range of 250 shards and per prompt source, the samples whose
prompt (token for token) occurred in an earlier shard or earlier in the same one: a greedy answer
to a repeated prompt is the same text again (up to the batch's bf16 numerics), so those samples
add no new text.

With `--drafts`, it also replays each draft's greedy chain at block 16 (teacher-forced features
from the feature store, as `train`'s held-out `holdout_tau_chain` does) on `train`'s 48 held-out
samples and on every `--every`-th training sample of `--shards` (whose features must be on disk),
and reports τ (tokens per block) per source, split by whether the sample's prompt occurred in a
shard before the range. It reports acceptance, not time.
"""

from __future__ import annotations

import argparse
import collections
import statistics
from pathlib import Path

import torch

from dflash_robot.training.data import Shard, shard_paths, token_key


def shard_number(name: str) -> int:
    """shard-01625 -> 1625; the session-1/2 shard-v1-* files -> -1 (they come first)."""
    tail = name.split("-")[-1]
    return -1 if "-v1-" in name else int(tail)


def repeat_tally(data: str) -> dict[bytes, int]:
    """Prints the repeat table; -> {prompt key: number of the shard it first occurred in}."""
    first: dict[bytes, int] = {}
    rows: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for p in sorted(shard_paths(data), key=lambda p: shard_number(p.stem)):  # v1 first, as written
        s, k = Shard.load(p), shard_number(p.stem)
        bucket = "v1" if k < 0 else f"{k // 250 * 250:04d}-{k // 250 * 250 + 249:04d}"
        for i in range(len(s)):
            a, b = int(s.offsets[i]), int(s.offsets[i + 1])
            start = int(s.response_start[i])
            key = token_key(s.tokens[a:a + start])
            row = rows[(bucket, s.source)]
            row[0] += 1
            row[2] += b - a - start
            if key not in first:
                first[key] = k
                row[1] += 1
                row[3] += b - a - start
    print("shards | source | samples | repeated prompts | response tokens | of them under a repeated prompt")
    tot = [0, 0, 0, 0]
    for (bucket, source), (n, new, tokens, new_tokens) in sorted(rows.items()):
        print(f"{bucket} | {source} | {n} | {n - new} ({(n - new) / n:.0%}) | {tokens} | "
              f"{tokens - new_tokens} ({(tokens - new_tokens) / tokens:.0%})")
        tot = [t + v for t, v in zip(tot, (n, new, tokens, new_tokens), strict=True)]
    print(f"all | all | {tot[0]} | {tot[0] - tot[1]} ({(tot[0] - tot[1]) / tot[0]:.0%}) | {tot[2]} | "
          f"{tot[2] - tot[3]} ({(tot[2] - tot[3]) / tot[2]:.0%})")
    return first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--drafts", default="", help="comma-separated: shipped, or draft directories")
    ap.add_argument("--shards", default="1625-1744", help="the range whose samples are replayed")
    ap.add_argument("--every", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    first = repeat_tally(args.data)
    if not args.drafts:
        return

    from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
    from dflash_robot.targets.loading import default_target_path, load_target_model
    from dflash_robot.training.data import FeatureStore, iter_samples
    from dflash_robot.training.prompts import HUMANEVAL_WRAPPER
    from dflash_robot.training.run import TrainRun, prompt_key, split_holdout
    from dflash_robot.training.trainer import DraftTrainer, OptimConfig

    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.shards.split("-"))
    run = TrainRun(data=args.data, out="unused")
    hold, train = split_holdout(iter_samples(args.data, run.max_len), run)
    picked = [s for s in train if lo <= shard_number(s[2][0]) <= hi][::args.every]
    sources = {p.stem: Shard.load(p).source for p in shard_paths(args.data) if lo <= shard_number(p.stem) <= hi}

    model, tok = load_target_model(default_target_path(), None, "float32", "cpu")
    stub = HUMANEVAL_WRAPPER.split("\n")[0]

    def group(sample: tuple) -> tuple[str, str]:
        ids, mask, key = sample
        earlier = first.get(prompt_key(sample), hi + 1) < lo
        source = sources[key[0]]
        if source == "docstring":  # the two request formats of `prompts.docstring_prompts`
            source += " (HumanEval stub)" if stub in tok.decode(ids[:int(mask.nonzero()[0])]) else " (plain request)"
        return source, "prompt in an earlier shard" if earlier else "new prompt"

    for name in args.drafts.split(","):
        draft = load_draft(SHIPPED_DRAFT if name == "shipped" else name)
        store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
        tr = DraftTrainer(model, draft, OptimConfig(bf16_autocast=True), store=store)
        held = [g for ids, mask, key in hold for g in tr.chain_acceptance(ids, mask, key, block_size=args.block_size)]
        print(f"{name} | held-out ({len(hold)} samples) | block {args.block_size} | {len(held)} blocks | "
              f"chain tau {statistics.mean(held):.3f}", flush=True)
        groups: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
        for s in picked:
            gains = tr.chain_acceptance(s[0], s[1], s[2], block_size=args.block_size)
            src, rep = group(s)
            keys = {(src, rep), ("all", rep), (src, "any"), ("all", "any")}
            if src.startswith("docstring "):
                keys |= {("docstring", rep), ("docstring", "any")}
            for k in keys:
                groups[k] += gains
        for (src, rep), gains in sorted(groups.items()):
            print(f"{name} | shards {args.shards}, every {args.every}th ({len(picked)} samples) | {src} | {rep} | "
                  f"{len(gains)} blocks | chain tau {statistics.mean(gains):.3f}", flush=True)


if __name__ == "__main__":
    main()
