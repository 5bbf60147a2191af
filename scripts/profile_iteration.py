"""Measure the cost of each step of one DFlash iteration on a real target.

Usage: python scripts/profile_iteration.py [--dtype float32] [--block-size 16] [--context 256]
                                           [--fast-linears]
Runs the same functions the orchestrator runs, timing each with perf_counter (CPU: synchronous).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from dflash_robot.drafts.checkpoint import load_draft
from dflash_robot.drafts.model import build_draft
from dflash_robot.runtime.acceptance import greedy_accept
from dflash_robot.runtime.api import DEFAULT_DRAFT, DFlashRuntime
from dflash_robot.targets.loading import default_target_path, load_target_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fast-linears", action="store_true", help="pack fp32 linears for oneDNN (fastpath.py)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_target_model(default_target_path(), dtype=args.dtype)
    dtype = model.dtype
    try:
        draft = load_draft(args.draft, dtype=dtype)
        which = str(args.draft)
    except Exception:  # noqa: BLE001 - no shipped draft yet: timings do not depend on weights
        draft = build_draft(model.config, 2, 16, mask_token_id=16).to(dtype)
        which = "random 2-layer draft (same shape)"
    rt = DFlashRuntime.from_models(model, draft, tok, fast_linears=args.fast_linears)
    tgt, prop = rt.target, rt.orchestrator.drafter
    q, taps = args.block_size, draft.metadata.target_layer_ids
    prompt = torch.randint(100, 40000, (args.context,))
    times: dict[str, list[float]] = {}

    def tick(name: str, t0: float) -> float:
        t1 = time.perf_counter()
        times.setdefault(name, []).append((t1 - t0) * 1e3)
        return t1

    out = tgt.prefill(prompt, taps, 512)
    prop.reset()
    feats = out.features
    last = out.logits[-1].argmax().view(1)
    for _ in range(args.iters + 3):
        t = time.perf_counter()
        block = torch.full((q,), draft.metadata.mask_token_id, dtype=torch.long)
        block[:1] = last
        t = tick("1 build block", t)
        logits = prop.propose(feats, block)
        t = tick("2 draft forward + lm_head (q-1 rows)", t)
        block[1:] = logits.argmax(-1)
        t = tick("3 draft argmax", t)
        snap = tgt.snapshot()
        v = tgt.verify(block, taps)
        t = tick("4 target verify forward (q tokens, taps)", t)
        acc = greedy_accept(block[1:], v.logits)
        stops = torch.tensor([2])
        is_stop = torch.isin(acc.tokens, stops)
        first_stop = torch.where(is_stop.any(), is_stop.to(torch.int64).argmax(), q)
        packed = torch.cat([acc.num_accepted.view(1), first_stop.view(1), acc.tokens])
        t = tick("5 acceptance + stop scan (device)", t)
        host = packed.tolist()
        t = tick("6 device->host transfer (the one sync)", t)
        produced = 1  # worst case for cost: keep one token, re-grow next iteration
        tgt.rollback(snap, produced)
        feats = v.features[:produced]
        last = acc.tokens[produced - 1:produced]
        t = tick("7 rollback (cache crop) + feature slice", t)
        del host
    # the same target called directly through transformers, for comparison with step 4
    for qq in (1, q):
        bare = []
        for _ in range(8):
            cache = DynamicCache(config=model.config)
            with torch.inference_mode():
                model(input_ids=prompt[None], cache=cache, use_cache=True, logits_to_keep=1)
                t = time.perf_counter()
                model(input_ids=prompt[None, :qq], position_ids=torch.arange(args.context, args.context + qq)[None],
                      cache=cache, use_cache=True)
                bare.append((time.perf_counter() - t) * 1e3)
        times[f"(bare transformers forward, q={qq}, no dflash-robot code)"] = bare
    print(f"target: SmolLM2-135M-Instruct ({args.dtype}, packed linears: {args.fast_linears}), draft: {which}, "
          f"block {q}, "
          f"context {args.context}, {args.threads} threads, median of {args.iters}")
    total = 0.0
    for name, ts in times.items():
        med = statistics.median(ts[3:])
        total += med if not name.startswith("(") else 0.0
        print(f"| {name} | {med:.3f} ms |")
    print(f"| total (steps 1-7) | {total:.2f} ms |")


if __name__ == "__main__":
    main()
