"""The cost of each step of one tree iteration (DDTree) against the chain's, on the default target.

Usage: python scripts/profile_tree.py [--threads 2] [--context 256] [--reps 15]
                                      [--budgets 3,7,15,32] [--draft DIR] [--lookup 7]

Loads the embedded default target (lean engine, default precision) and the draft, prefills
--context random tokens, then for the chain at q = budget + 1 (at most 16) and the tree of each
budget at the same q times, median over --reps: the draft forward, building the tree (top-k,
level-by-level selection, ancestor mask), the verify forward (q rows for the chain, budget + 1
rows under the ancestor mask for the tree), acceptance plus the one host transfer, and the
rollback / compaction of a depth-2 path. With `--lookup N` it also times the n-gram lookup
(`runtime/lookup.py`: the host-side search over a history of --context tokens that ends in a
repeated 4-gram, so that it matches) and merging its N-token branch into a block-4 chain
(`tree.attach_chain`, on the CPU path that drops the shared rows). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.lookup import NgramLookup
from dflash_robot.runtime.tree import attach_chain, build_tree, chain_tree, tree_accept


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--budgets", default="3,7,15,32")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--lookup", type=int, default=0, help="also time an n-gram lookup branch of N tokens")
    args = ap.parse_args()
    if args.lookup < 0 or (args.lookup and args.context < 104 + args.lookup):
        ap.error("--lookup N needs N >= 0 and --context >= 104 + N (its history repeats tokens 100..103)")
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load(draft=args.draft)
    tgt, drafter = rt.target, rt.orchestrator.drafter
    taps = drafter.metadata.target_layer_ids
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, tgt.vocab_size, (args.context,), generator=g)
    feats = tgt.prefill(prompt, taps, 512).features
    drafter.reset(prompt)  # as a request does (a prompt_vocab draft's columns)
    mask = drafter.metadata.mask_token_id
    out = {}
    for n in [int(x) for x in args.budgets.split(",")]:
        q = min(16, n + 1)
        t: dict[str, list[float]] = {k: [] for k in ("draft", "build_tree", "verify_tree", "accept_sync",
                                                     "compact", "chain_verify", "chain_accept_sync",
                                                     "chain_rollback")}
        for _ in range(args.reps + 1):
            block = torch.full((q,), mask)
            block[0] = prompt[-1]
            t0 = time.perf_counter()
            logits = drafter.propose(feats[:1], block)
            t1 = time.perf_counter()
            tree = build_tree(block[:1], F.log_softmax(logits.float(), dim=-1), n, n, drafter.vocab_ids)
            t2 = time.perf_counter()
            snap = tgt.snapshot()
            v = tgt.verify_tree(tree.tokens, tree.depths, tree.ancestors, taps)
            t3 = time.perf_counter()
            acc = tree_accept(tree, v.logits.argmax(-1))
            torch.cat([acc.num_accepted.view(1), acc.tokens, acc.path]).tolist()
            t4 = time.perf_counter()
            deep = [0] + [j for j in range(1, tree.size) if int(tree.parents[j]) == 0][:1]
            tgt.compact(snap, deep)
            t5 = time.perf_counter()
            tgt.crop(snap.seq_len)
            block[1:] = logits.argmax(-1) if drafter.vocab_ids is None else drafter.vocab_ids[logits.argmax(-1)]
            t6 = time.perf_counter()
            cv = tgt.verify(block, taps)
            t7 = time.perf_counter()
            post = cv.logits.argmax(-1)
            torch.cat([(block[1:] == post[:-1]).long().cumprod(0).sum().view(1), post]).tolist()
            t8 = time.perf_counter()
            tgt.rollback(snap, 2)
            t9 = time.perf_counter()
            tgt.crop(snap.seq_len)
            for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t7 - t6, t8 - t7, t9 - t8),
                             strict=True):
                t[k].append(dt)
        out[f"budget {n}, q {q}"] = {k: round(1000 * statistics.median(v[1:]), 3) for k, v in t.items()}
    if args.lookup:
        hist = torch.cat([prompt, prompt[100:104]])  # its last 4-gram occurs once before
        lookup = NgramLookup(4, 3)
        block = torch.cat([prompt[-1:], prompt[:3]])
        tl: dict[str, list[float]] = {"lookup": [], "attach_chain": []}
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            branch = lookup.propose(hist, args.lookup)
            t1 = time.perf_counter()
            attach_chain(chain_tree(block), branch, drop_dead=True)
            t2 = time.perf_counter()
            tl["lookup"].append(t1 - t0)
            tl["attach_chain"].append(t2 - t1)
        assert branch.numel() == args.lookup
        out[f"lookup {args.lookup}, q 4"] = {k: round(1000 * statistics.median(v[1:]), 3) for k, v in tl.items()}
    print(json.dumps({"ms": out, "context": args.context, "threads": args.threads,
                      "precision": rt.info.get("precision"), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                     time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
