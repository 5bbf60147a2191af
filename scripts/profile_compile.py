"""What `torch.compile` buys the lean engine's step: the 30-layer stack of the default target
(precision gguf; the head stays eager: inductor's lowering of the oneDNN-packed bf16 product asserts)
compiled as one graph, against the same code eager, in the same process; then whether a compiled
q-row verify equals q compiled single-token steps bit for bit (lossless needs it).

Usage: python scripts/profile_compile.py [--cpp-wrapper] [--threads 2]
(compiling takes ~1 minute per graph here; TORCHINDUCTOR_CACHE_DIR picks the cache to use)

docs/BENCHMARKS.md (session 6) quotes it. Not used by the runtime (see there why).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from dflash_robot.targets import lean as L
from dflash_robot.targets.loading import default_target_path, load_target_model

TAPS = (1, 10, 14, 19, 27)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpp-wrapper", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import torch._inductor.config as inductor_config

    inductor_config.cpp_wrapper = args.cpp_wrapper
    path = default_target_path()
    model, _ = load_target_model(path, dtype="float32")
    eng = L.LeanTargetAdapter(model, precision="gguf", gguf_file=str(path), kernels=False)  # the torch path

    def body(ids: torch.Tensor, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        t = ids.shape[0]
        nh, nkv, dd = eng.n_heads, eng.n_kv, eng.head_dim
        feats = []
        x = F.embedding(ids, eng.embed)
        for i, layer in enumerate(eng.layers):
            qkv = layer.qkv(L._rms(x, layer.ln1, eng.eps))
            qk = L.rope(qkv[:, :(nh + nkv) * dd].view(t, nh + nkv, dd), cos, sin)
            q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * dd:].view(t, nkv, dd)
            eng._k[i][:, start:end] = k.transpose(0, 1)
            eng._v[i][:, start:end] = v.transpose(0, 1)
            qh = q.reshape(t, nkv, nh // nkv, dd).permute(1, 2, 0, 3).reshape(nkv, -1, dd)
            o = L._attend(qh, eng._k[i][:, :end], eng._v[i][:, :end], mask)
            x = x + layer.o(o.view(nkv, nh // nkv, t, dd).permute(2, 0, 1, 3).reshape(t, nh * dd))
            gate, up = layer.gate_up(L._rms(x, layer.ln2, eng.eps)).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i in TAPS:
                feats.append(x)
        return L._rms(x, eng.final_norm, eng.eps), torch.cat(feats, -1)

    compiled = torch.compile(body, dynamic=True)

    @torch.inference_mode()
    def forward(ids: torch.Tensor, comp: bool) -> torch.Tensor:
        t, start = ids.shape[0], eng._len
        end = start + t
        cos, sin = eng._cos[start:end][:, None, :], eng._sin[start:end][:, None, :]
        mask = None
        if t > 1:
            key = torch.arange(end)
            mask = (key[None, :] <= (start + torch.arange(t))[:, None]).repeat(eng.n_heads // eng.n_kv, 1)
        x, _ = (compiled if comp else body)(ids, start, end, cos, sin, mask)
        eng._len = end
        return eng._head_module(x)

    eng.prefill(torch.randint(100, 40000, (256,)), TAPS, 512)
    for q in (1, 4):
        t0 = time.perf_counter()
        for _ in range(3):
            forward(torch.randint(100, 40000, (q,)), True)
            eng._len -= q
        print(f"compile + 3 calls, q={q}: {time.perf_counter() - t0:.1f} s", flush=True)
    for comp in (False, True):
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            forward(torch.randint(100, 40000, (1,)), comp).argmax(-1).tolist()
            eng._len -= 1
            times.append(time.perf_counter() - t0)
        print(f"q=1 at context 256, {'compiled' if comp else 'eager'}: {sorted(times)[10] * 1e3:.2f} ms", flush=True)
    ids, base = torch.randint(100, 40000, (4,)), eng._len
    batched = forward(ids, True)
    eng._len = base
    single = torch.cat([forward(ids[i:i + 1], True) for i in range(4)])
    eng._len = base
    print("compiled q=4 rows against 4 compiled steps: max difference",
          float((batched - single).abs().max()))


if __name__ == "__main__":
    main()
