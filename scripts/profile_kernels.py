"""Where one lean-engine step goes with the fused kernels: each kernel and product timed alone at
SmolLM2-135M's shapes, against the whole step, at q = 1 and 4 or `--block-sizes` (context 256,
precision gguf).

Usage: python scripts/profile_kernels.py [--threads 2] [--context 256] [--block-sizes 1,4,16]

docs/ARCHITECTURE.md ("The lean engine") quotes its output. "python + dispatch" is the step minus
the sum of the parts: the per-call cost of ~9 Python-level calls per layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_robot.targets import kernels
from dflash_robot.targets.lean import LeanTargetAdapter
from dflash_robot.targets.loading import default_target_path, load_target_model


def median_us(f, reps: int = 200) -> float:
    for _ in range(10):
        f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--block-sizes", default="1,4", help="verify widths q to time (comma-separated)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_target_path()
    model, _ = load_target_model(path, dtype="float32")
    eng = LeanTargetAdapter(model, precision="gguf", gguf_file=str(path))
    ops = kernels.load()
    assert ops is not None and eng.fused_kernels, kernels.unavailable_reason()
    taps = (1, 14, 27)
    eng.prefill(torch.randint(100, 40000, (args.context,)), taps, 512)
    layer, n = eng.layers[0], eng.num_layers
    hdim, eps = eng.hidden_size, eng.eps
    for q in (int(b) for b in args.block_sizes.split(",")):
        snap = eng.snapshot()

        def step(q=q, snap=snap):
            eng.verify(torch.randint(100, 40000, (q,)), taps).logits.argmax(-1).tolist()
            eng.rollback(snap, 1)

        total = median_us(step, 60)
        x = torch.randn(q, hdim)
        h = ops.rms_norm(x, layer.ln1, eps, True)
        qkv = layer.qkv(h)
        a = ops.attention(qkv, eng._k[0], eng._v[0], eng._cos, eng._sin, eng.seq_len, eng.n_heads, None, None,
                          None, None, eps, True)
        o = layer.o(a)
        gu = layer.gate_up(h)
        act = ops.silu_mul(gu, True)
        dn = layer.down(act)
        parts = {
            "products (qkv, o, gate_up, down) x layers": n * sum(median_us(lambda f=f, v=v: f(v)) for f, v in
                                                               ((layer.qkv, h), (layer.o, a), (layer.gate_up, h),
                                                                (layer.down, act))),
            "attention kernel x layers": n * median_us(lambda qkv=qkv: ops.attention(
                qkv, eng._k[0], eng._v[0], eng._cos, eng._sin, eng.seq_len, eng.n_heads, None, None, None, None,
                eps, True)),
            "norm kernels (2 per layer)": 2 * n * median_us(
                lambda x=x, o=o: ops.add_rms_norm(x, o, layer.ln2, eps, True)),
            "silu_mul kernel x layers": n * median_us(lambda gu=gu: ops.silu_mul(gu, True)),
            "output head (bf16, 49152 x 576)": median_us(lambda x=x: eng._head_module(x)),
        }
        del dn
        print(f"q={q}, context {args.context}: whole step {total / 1e3:.2f} ms")
        for k, v in parts.items():
            print(f"  {k}: {v / 1e3:.2f} ms")
        print(f"  python + dispatch + embedding + sampling (the rest): {(total - sum(parts.values())) / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
