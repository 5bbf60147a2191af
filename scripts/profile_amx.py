"""The AMX products of the fused kernels (`q4_mm`, `q8_mm`) against the kernels they replace, at
SmolLM2-135M's shapes, with the weights out of cache as in a decode step.

Usage: python scripts/profile_amx.py [--threads 2] [--rows 1,4,8,16] [--reps 30]

- int4: the 120 products of SmolLM2's 30 layers (q/k/v, o, gate/up, down), random Q4_1-form
  weights, called in order so each one's weights come from memory (66 MB in all): torch's
  `_weight_int4pack_mm_for_cpu` against `q4_mm`, alternated.
- head: the 49,152 x 576 output head, bf16 (oneDNN, what the engine ran before) against int8
  groups of 32 (`q8_mm`, the GGUF's Q8_0), with 64 MB streamed through the caches before each call.
Prints the median milliseconds per row count. docs/BENCHMARKS.md (session 16) quotes it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_robot.targets import kernels
from dflash_robot.targets.quant import Int8GroupWeight, make_linear, quantize_int4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8,16")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels.amx()
    if ops is None:
        raise SystemExit(f"no AMX product here: {kernels.unavailable_reason() or 'this CPU or OS has no AMX-BF16'}")
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    amx, tor = [], []
    for n, k in shapes:
        w4 = quantize_int4(torch.randn(n, k, generator=g) * 0.05)
        amx.append(ops.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.contiguous(), w4.zero.contiguous()))
        tor.append((torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.q.contiguous(), 2),
                    torch.stack([w4.scale.t(), w4.zero.t()], dim=-1).to(torch.bfloat16).contiguous()))
    xs = {(k, m): torch.randn(m, k, generator=g).bfloat16() for k in (576, 1536) for m in rows}
    print(f"int4, SmolLM2's 120 layer products in turn (weights from memory), {args.threads} threads, "
          f"median of {args.reps}:")
    for m in rows:
        res: dict[str, list[float]] = {"torch int4": [], "q4_mm (AMX)": []}
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for (_, k), (p, sz) in zip(shapes, tor, strict=True):
                torch.ops.aten._weight_int4pack_mm_for_cpu(xs[k, m], p, 32, sz)
            res["torch int4"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for (_, k), p in zip(shapes, amx, strict=True):
                ops.q4_mm(xs[k, m], p, True)
            res["q4_mm (AMX)"].append(time.perf_counter() - t0)
        print(f"  {m:2d} rows: " + ", ".join(f"{a} {statistics.median(v) * 1e3:.2f} ms" for a, v in res.items()))

    n, k = 49152, 576
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // 32, generator=g) * 1e-3).half().float()
    w8 = Int8GroupWeight(q, scale)
    bf16 = make_linear(w8.dequantize(), None, "bf16")
    packed = ops.q8_pack(q, scale)
    flush = torch.zeros(64 * 1024 * 1024 // 4)
    print(f"output head {n} x {k}, 64 MB streamed through the caches before each call, median of {args.reps}:")
    for m in rows:
        x = torch.randn(m, k, generator=g)
        xb = x.bfloat16()
        res = {"bf16 (oneDNN)": [], "q8_mm (AMX)": []}
        for _ in range(args.reps):
            flush.add_(1.0)
            t0 = time.perf_counter()
            bf16(x)
            res["bf16 (oneDNN)"].append(time.perf_counter() - t0)
            flush.add_(1.0)
            t0 = time.perf_counter()
            ops.q8_mm(xb, packed, False)
            res["q8_mm (AMX)"].append(time.perf_counter() - t0)
        print(f"  {m:2d} rows: " + ", ".join(f"{a} {statistics.median(v) * 1e3:.2f} ms" for a, v in res.items()))


if __name__ == "__main__":
    main()
