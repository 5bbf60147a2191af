"""Where the lean engine's forward time goes: medians at q=1 and q=16, then torch.profiler's
op table for 5 verifies of --profile-q tokens.

Usage: python scripts/profile_lean_ops.py [--profile-q 1|16] [--threads 2]

The lean engine alone (the HF model's own layers are released after the engine copies them),
SmolLM2-135M-Instruct fp32, context 256, the shipped draft's 3 taps. docs/ARCHITECTURE.md
("The lean engine") quotes this script's output, run on 2026-11-29 with --profile-q 1 and 16.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from torch.profiler import profile

from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.loading import default_target_path, load_target_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile-q", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_target_model(default_target_path(), dtype="float32")
    lean = LeanTargetAdapter(model)
    del model
    gc.collect()
    taps = (1, 14, 27)
    lean.prefill(torch.randint(100, 40000, (256,)), taps, 512)

    def step(q: int) -> None:
        snap = lean.snapshot()
        out = lean.verify(torch.randint(100, 40000, (q,)), taps)
        out.logits.argmax(-1).tolist()
        lean.rollback(snap, 1)

    for q in (1, 16):
        for _ in range(3):
            step(q)
        ts = []
        for _ in range(15):
            t0 = time.perf_counter()
            step(q)
            ts.append(time.perf_counter() - t0)
        print(f"q={q}: median {sorted(ts)[7] * 1e3:.1f} ms")
    with profile() as prof:
        for _ in range(5):
            step(args.profile_q)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
