"""Time one self-distillation batch with transformers `generate` and with `data.greedy_batch`.

Usage: python scripts/profile_data_gen.py [--source math] [--seed 5001] [--max-new-tokens 256] [--threads 2]

The default target in bf16 (as `dflash-robot data` loads it), 64 prompts of one source (`--seed`
picks them; the data command's own shards use seed*100003 + k), the five taps 1,10,14,19,27 recorded.
Prints each method's seconds and response tokens, how many rows' answers agree, and, where all do,
the largest feature difference over every row but each answer's last (which only `generate` feeds
back, for rows that finished before the batch did). Run it alone: it is a timing.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from dflash_robot.targets.loading import default_target_path, load_target_model
from dflash_robot.training import data as D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", default="math", choices=["math", "docstring", "selfmath", "self"])
    ap.add_argument("--seed", type=int, default=5001)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target_model(default_target_path(), None, "bfloat16", "cpu")
    tok.padding_side = "left"
    texts = D.shard_prompts(model, tok, args.source, args.batch_size, args.seed)
    chats = D.chat_texts(tok, texts)
    stop = [tok.eos_token_id]
    tap = D.FeatureTap(model, [1, 10, 14, 19, 27])
    out = {}
    for name in ("generate", "greedy_batch"):
        t = time.perf_counter()
        if name == "generate":
            r = D.batch_generate(model, tok, chats, args.max_new_tokens, 0.0, stop, 0, tap)
        else:
            r = D.greedy_batch(model, tok, chats, args.max_new_tokens, stop, tap)
        dt = time.perf_counter() - t
        assert r[2] is not None
        out[name] = (r, D._unpad_features(r[2], r[0], r[1], r[3]))
        print(f"{name}: {dt:.1f} s, {sum(map(len, r[1]))} response tokens", flush=True)
    (a, fa), (b, fb) = out["generate"], out["greedy_batch"]
    eq = [x == y for x, y in zip(a[1], b[1], strict=True)]
    print(f"rows with equal answers: {sum(eq)} / {len(eq)}")
    if all(eq):
        last = torch.from_numpy(np.cumsum([len(p) + len(r) for p, r in zip(a[0], a[1], strict=True)]) - 1)
        keep = torch.ones(fa.shape[0], dtype=torch.bool)
        keep[last] = False
        d = (fa.float() - fb.float()).abs()
        print(f"features: max |difference| over all rows but each answer's last: {d[keep].max().item()}")


if __name__ == "__main__":
    main()
