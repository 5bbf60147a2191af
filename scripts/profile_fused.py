"""The lean engine with and without its fused kernels, side by side in one process: logits
agreement after a prefill, bit-identity of a 16-token verify with 16 single steps (fused), and
verify medians at q = 1, 4, 16 (context 200, 3 taps).

Usage: python scripts/profile_fused.py [--precision gguf] [--threads 2]

docs/BENCHMARKS.md (session 7) quotes it.
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
    fused = LeanTargetAdapter(model, precision=args.precision, gguf_file=str(path))
    plain = LeanTargetAdapter(model, precision=args.precision, gguf_file=str(path), kernels=False)
    assert fused.fused_kernels and not plain.fused_kernels
    taps = (1, 14, 27)
    prompt = torch.randint(100, 40000, (200,))
    a, b = fused.prefill(prompt, taps, 512), plain.prefill(prompt, taps, 512)
    print(f"prefill: max |logit difference| {(a.logits - b.logits).abs().max().item():.4f}, "
          f"same argmax {bool((a.logits.argmax(-1) == b.logits.argmax(-1)).all())}")
    block = torch.randint(100, 40000, (16,))
    snap = fused.snapshot()
    batched = fused.verify(block, taps)
    fused.rollback(snap, 0)
    single = fused.verify(block, taps, sequential=True)
    fused.rollback(snap, 0)
    print("fused verify of 16 == 16 single steps, bit for bit:",
          torch.equal(batched.logits, single.logits) and torch.equal(batched.features, single.features))
    for eng, name in ((fused, "fused"), (plain, "torch path")):
        for q in (1, 4, 16):
            ts = []
            for _ in range(30):
                s = eng.snapshot()
                t0 = time.perf_counter()
                eng.verify(torch.randint(100, 40000, (q,)), taps).logits.argmax(-1).tolist()
                ts.append(time.perf_counter() - t0)
                eng.rollback(s, 1)
            print(f"{name} q={q}: median {sorted(ts)[15] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
