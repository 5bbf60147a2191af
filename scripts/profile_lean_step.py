"""One lean-engine verify step (at the default precision gguf): medians at context 256 and 1024
for q = 1, 4, 16, with the 5 taps of the committed training features, plus the rollback.

Usage: python scripts/profile_lean_step.py [--precision gguf] [--threads 2]

docs/BENCHMARKS.md (session 6) quotes it for each change tried on the step.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.loading import default_target_path, load_target_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="gguf")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_target_path()
    model, _ = load_target_model(path, dtype="float32")
    lean = LeanTargetAdapter(model, precision=args.precision, gguf_file=str(path))
    taps = (1, 10, 14, 19, 27)
    for ctx in (256, 1024):
        lean.prefill(torch.randint(100, 40000, (ctx,)), taps, 512)
        for q in (1, 4, 16):
            times = []
            for _ in range(44):
                snap = lean.snapshot()
                t0 = time.perf_counter()
                lean.verify(torch.randint(100, 40000, (q,)), taps).logits.argmax(-1).tolist()
                lean.rollback(snap, 1)
                times.append(time.perf_counter() - t0)
            print(f"ctx={ctx} q={q}: median {sorted(times[3:])[20] * 1e3:.2f} ms", flush=True)


if __name__ == "__main__":
    main()
