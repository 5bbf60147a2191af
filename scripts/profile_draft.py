"""The cost of one draft proposal: the lean forward (`drafts/lean.py`) at each weight precision,
and with `--module` also the module forward (`DFlashDraft.forward`) and the lean forward's torch
path, on the default target; for the shipped draft or any others, each with its own tap count.

Usage: python scripts/profile_draft.py [--threads 2] [--drafts shipped,DIR,...] [--precisions ...]

One proposal after 200 tokens of context with 2 new context rows (a decode step), median of 50,
argmax and the host transfer included. docs/BENCHMARKS.md (sessions 6 and 7) quotes it.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from dflash_robot.runtime.api import DFlashRuntime
from dflash_robot.runtime.proposer import DFlashProposer
from dflash_robot.targets.fastpath import pack_linears


def _set_context(prop: DFlashProposer, n: int) -> None:
    if prop._lean is not None:
        prop._lean.length = n
    else:
        assert prop._cache is not None
        prop._cache.length = n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafts", default="shipped",
                    help="comma-separated: 'shipped' or draft directories; each is profiled on the same target")
    ap.add_argument("--precisions", default="fp32,bf16,int8,int4", help="the lean forward's weight precisions")
    ap.add_argument("--module", action="store_true",
                    help="also the module forward and the lean torch path (kernels off), as sessions 5-6 ran them")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rt = DFlashRuntime.load()
    emb, head = rt.target.input_embedding_weight(), rt.target.output_head()
    from dflash_robot.drafts.checkpoint import load_draft
    from dflash_robot.drafts.lean import LeanDraftForward

    variants = []
    for spec in args.drafts.split(","):
        draft = rt.draft if spec == "shipped" else load_draft(spec, dtype=torch.float32)
        assert draft is not None
        label = f"{spec} ({len(draft.layers)} layers)"
        if args.module:
            packed = copy.deepcopy(draft)
            pack_linears(packed)  # session 5's path: the module with oneDNN-packed fp32 linears
            variants.append((f"{label}, module, fp32", DFlashProposer(packed, emb, head, lean=False)))
        variants += [(f"{label}, lean, {p}", DFlashProposer(draft, emb, head, precision=p))
                     for p in args.precisions.split(",")]
        if args.module:
            for p in ("fp32", "int8"):  # the lean forward's torch path (fused kernels off), as session 6 ran it
                prop = DFlashProposer(draft, emb, head, precision=p)
                prop._lean = LeanDraftForward(draft, p, kernels=False)
                variants.append((f"{label}, lean, {p}, torch path", prop))
    for name, prop in variants:
        feats = torch.randn(200, prop.draft.fc.in_features)  # the draft's own taps x hidden size
        row = []
        for q in (4, 16):
            blk = torch.tensor([5] + [prop.metadata.mask_token_id] * (q - 1))
            prop.reset()
            prop.propose(feats, blk)  # 200 committed context rows
            times: list[float] = []
            for _ in range(60):  # each: a decode step with 2 new context rows, then back to 200
                t0 = time.perf_counter()
                prop.propose(feats[:2], blk).argmax(-1).tolist()
                times.append(time.perf_counter() - t0)
                _set_context(prop, 200)
            row.append(f"block {q}: {sorted(times[10:])[25] * 1e3:.2f} ms")
        print(f"{name:44s} " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
