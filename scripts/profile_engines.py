"""Target forward cost, HF engine against the lean engine, side by side in one process.

Usage: python scripts/profile_engines.py [--threads 2] [--context 256] [--reps 15]
                                         [--block-sizes 1,2,4,8,16]

Loads the embedded default target (SmolLM2-135M-Instruct, fp32) once, builds both adapters
over the same weights (HF with oneDNN-packed linears, as `DFlashRuntime.load` runs it; lean
from `lean.py`), prefills --context random tokens, then times verify(q) + rollback(1) with the
draft's three tapped layers, median over --reps, alternating engines every repetition so
that drift on a shared box hits both alike. Also reports the largest logit difference.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from dflash_robot.targets.fastpath import pack_linears
from dflash_robot.targets.hf import HFTargetAdapter
from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.loading import default_target_path, load_target_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--block-sizes", default="1,2,4,8,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target_model(default_target_path(), dtype="float32")
    lean = LeanTargetAdapter(model)  # built from the unpacked weights
    pack_linears(model)
    hf = HFTargetAdapter(model)
    taps = (1, 14, 27)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.context,), generator=g)
    rows = []
    for q in [int(x) for x in args.block_sizes.split(",")]:
        times: dict[str, list[float]] = {"hf": [], "lean": []}
        diff = 0.0
        for eng in (hf, lean):
            eng.prefill(prompt, taps, 512)
        for r in range(args.reps + 2):
            block = torch.randint(100, 40000, (q,), generator=g)
            outs = {}
            for name, eng in (("hf", hf), ("lean", lean)):
                snap = eng.snapshot()
                t0 = time.perf_counter()
                out = eng.verify(block, taps)
                out.logits.argmax(-1).tolist()
                eng.rollback(snap, 1)
                if r >= 2:
                    times[name].append(time.perf_counter() - t0)
                outs[name] = out.logits
            diff = max(diff, float((outs["hf"] - outs["lean"]).abs().max()))
        row = {"q": q, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}, "max_logit_diff": diff}
        row["speedup"] = row["hf_ms"] / row["lean_ms"]
        rows.append(row)
        print(json.dumps(row))
    print(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
                      "threads": args.threads, "context": args.context, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
