"""Where a draft loses acceptance, on the training pipeline's held-out set (docs/TRAINING.md).

Usage: python scripts/diagnose_draft.py [--draft PATH] [--data data/smollm2-selfdistill]
                                        [--block-size 16] [--train-samples 48] [--threads 2]

Prints, for greedy chain decoding replayed on the held-out samples (`DraftTrainer.chain_acceptance`)
and on as many training samples:
- tau, and the acceptance rate of draft position k given that positions 1..k-1 were accepted
  (a flat profile says every token is equally hard; a falling one says errors compound);
- the draft's first-position accuracy at every response anchor, binned by the target's own
  confidence there (its top probability for that token), which separates tokens the target finds
  hard from tokens the draft fails on although the target is sure;
- the same accuracy split by whether the token continues a bigram seen earlier in the sequence
  (x[a], x[a+1] occurred before): those are tokens the target gets by copying from the context;
- tau with the draft's target features zeroed, or with only one tapped layer kept (the others
  zeroed), which shows how much each tap carries.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import torch

from dflash_robot.drafts.checkpoint import SHIPPED_DRAFT, load_draft
from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training import objective
from dflash_robot.training.data import FeatureStore
from dflash_robot.training.run import evaluation_samples
from dflash_robot.training.trainer import DraftTrainer, OptimConfig

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)


class _Ablated(DraftTrainer):
    """Features with some taps zeroed: `keep` None keeps all, () keeps none, (i,) keeps tap i."""

    keep: tuple[int, ...] | None = None

    def features(self, input_ids, key):
        f = super().features(input_ids, key)
        if self.keep is None:
            return f
        h = f.shape[-1] // len(self.draft.metadata.target_layer_ids)
        out = torch.zeros_like(f)
        for i in self.keep:
            out[:, i * h:(i + 1) * h] = f[:, i * h:(i + 1) * h]
        return out


def profile(tr: DraftTrainer, samples: list, q: int) -> tuple[float, list[float]]:
    gains = [g for s in samples for g in tr.chain_acceptance(s[0], s[1], s[2], block_size=q)]
    n = len(gains)
    at_least = [sum(1 for g in gains if g - 1 >= k) / n for k in range(q)]  # P(run >= k)
    cond = [at_least[k] / at_least[k - 1] if at_least[k - 1] else float("nan") for k in range(1, q)]
    return sum(gains) / n, cond


@torch.no_grad()
def confidence_bins(tr: DraftTrainer, model, samples: list, q: int
                    ) -> tuple[list[tuple[float, float]], dict[bool, tuple[float, float]]]:
    """-> ([(share, draft accuracy)] per target-confidence bin, {copyable: (share, accuracy)})."""
    draft, meta = tr.draft, tr.draft.metadata
    cnt, hit = Counter(), Counter()
    ccnt, chit = Counter(), Counter()
    for s in samples:
        x, m = s[0], s[1]
        pmax = model(input_ids=x[None], use_cache=False).logits[0].float().softmax(-1).max(-1).values
        a = torch.nonzero(m[1:], as_tuple=True)[0]
        a = a[a < x.numel() - 1]
        ids, pos, _, _ = objective.block_inputs(x, m, a, q, meta.mask_token_id, meta.loss_decay)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = tr.block_states(draft, tr.features(x, s[2]), ids, pos, a, q)
            pred = draft.logits(h, tr.head).argmax(-1)
        if draft.vocab_ids is not None:
            pred = draft.vocab_ids[pred]
        ok = pred.view(-1, q)[:, 1] == x[a + 1]
        conf = pmax[a]  # the target's confidence in token a + 1
        xs, seen, copy = x.tolist(), set(), []
        for i in range(x.numel() - 1):
            copy.append((xs[i], xs[i + 1]) in seen)
            seen.add((xs[i], xs[i + 1]))
        copyable = torch.tensor(copy)[a]
        for c in (False, True):
            ccnt[c] += int((copyable == c).sum())
            chit[c] += int((ok & (copyable == c)).sum())
        for b in range(len(BINS) - 1):
            sel = (conf >= BINS[b]) & (conf < BINS[b + 1])
            cnt[b] += int(sel.sum())
            hit[b] += int((ok & sel).sum())
    total = sum(cnt.values())
    return ([(cnt[b] / total, hit[b] / max(cnt[b], 1)) for b in range(len(BINS) - 1)],
            {c: (ccnt[c] / total, chit[c] / max(ccnt[c], 1)) for c in (False, True)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(SHIPPED_DRAFT))
    ap.add_argument("--data", default="data/smollm2-selfdistill")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--train-samples", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    hold, train = evaluation_samples(args.data, args.train_samples)
    model, _ = load_target_model(default_target_path(), None, "float32", "cpu")
    draft = load_draft(args.draft).eval()
    store = FeatureStore(Path(args.data), draft.metadata.target_layer_ids, model.config.hidden_size)
    tr = _Ablated(model, draft, OptimConfig(bf16_autocast=True), store=store)
    q = args.block_size
    for name, ss in (("held-out", hold), (f"{len(train)} training samples", train)):
        tau, cond = profile(tr, ss, q)
        print(f"{name}: tau {tau:.3f} at block {q}; P(position k accepted | 1..k-1 accepted), k = 1..8: "
              + " ".join(f"{c:.2f}" for c in cond[:8]))
    print("held-out, draft position-1 accuracy by the target's confidence in that token:")
    bins, copy = confidence_bins(tr, model, hold, q)
    for b, (share, acc) in enumerate(bins):
        print(f"  target p_max in [{BINS[b]:.2f}, {min(BINS[b + 1], 1.0):.2f}]: {share:5.1%} of tokens, "
              f"draft accuracy {acc:.3f}")
    for c, label in ((True, "continues a bigram seen earlier"), (False, "does not")):
        print(f"  token {label}: {copy[c][0]:5.1%} of tokens, draft accuracy {copy[c][1]:.3f}")
    taps = draft.metadata.target_layer_ids
    for keep, label in [((), "no features"), *(((i,), f"only layer {t}") for i, t in enumerate(taps))]:
        tr.keep = keep
        print(f"held-out tau with {label}: {profile(tr, hold, q)[0]:.3f}")


if __name__ == "__main__":
    main()
