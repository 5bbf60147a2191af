"""Micro-benchmark of one linear product at SmolLM2-135M's shapes, 1 and 16 rows, 2 threads.

Usage: python scripts/microbench_linear.py

fp32: `F.linear`, the oneDNN-packed product (`fastpath.linear_fn`'s kernel) and `x @ W.T`;
low-bit weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`, group 32)
with fp32 and bf16 activations, on random weights (timing only). Medians in ms. Small weights
stay in cache across repetitions, so these are best cases; docs/ARCHITECTURE.md quotes the
lm_head rows (2026-11-29).
"""

# ruff: noqa: B023  (every closure below is timed at once, inside its own loop iteration)
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_ms(f, n: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2] * 1e3


def main() -> None:
    torch.set_num_threads(2)
    for name, (o, i) in SHAPES.items():
        w = torch.randn(o, i) / i ** 0.5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        wt = w.t().contiguous()
        w8, s8 = torch.randint(-127, 127, (o, i), dtype=torch.int8), torch.rand(o)
        w4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (o, i), dtype=torch.int32), 1)
        sz = torch.rand(i // 32, o, 2)
        for m in (1, 16):
            x = torch.randn(m, i)
            row = {"F.linear": median_ms(lambda: F.linear(x, w)),
                   "packed": median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")),
                   "x@W.T": median_ms(lambda: x @ wt)}
            for dt in (torch.float32, torch.bfloat16):
                xd = x.to(dt)
                tag = "fp32" if dt == torch.float32 else "bf16"
                row[f"int8 {tag}-act"] = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(xd, w8, s8.to(dt)))
                row[f"int4 {tag}-act"] = median_ms(
                    lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xd, w4, 32, sz.to(dt)))
            print(f"{name:8s} rows={m:2d} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
