"""Weight precisions of the lean engine: how a linear layer's weight is stored and multiplied.

Every product here is `x [M, K] fp32 -> y [M, N] fp32`; the residual stream, norms, RoPE,
attention and the KV cache stay fp32 whatever the precision, so only the weights (the bytes
a decode step must read) change:

| precision | weights | kernel | activations into the product |
|---|---|---|---|
| fp32 | fp32, oneDNN-packed | `mkldnn._linear_pointwise` | fp32 |
| bf16 | bf16, oneDNN-packed | `mkldnn._linear_pointwise` | bf16 |
| int8 | int8 per output channel, symmetric (scale = absmax / 127) | `aten._weight_int8pack_mm` | bf16 |
| int4 | int4 in groups of 32 along K, asymmetric (Q4_1's form) | `aten._weight_int4pack_mm_for_cpu` (1) | bf16 |
| gguf | the GGUF's own blocks: Q4_0 / Q4_1 as int4 (same groups, scales, offsets) | as int4 | bf16 |

(1) or, on a CPU with AMX-BF16, the fused kernels' `q4_mm` (`int4_linear`).

"gguf" keeps the file's groups, scales and offsets, rounded to bf16 (the kernel's type);
tensors of other GGUF types are dequantized and multiplied in bf16.

Row invariance (a row's result must not depend on how many rows share the call, or a 16-token
verify could disagree with 16 single-token steps): measured on the 2-core box (2026-11-30), the
int8 and int4 kernels have it at every SmolLM2 shape; the oneDNN fp32/bf16 products have it up
to K = 768 but not at K = 1536 (the MLP down projection), so those are cut into K-chunks of 512
(`_k_split`). `tests/test_precision.py` re-checks it on whatever machine runs the tests.

The int4 kernel computes `w = (q - 8) * scale + zero` per group, q in 0..15: Q4_1's
`w = d * q + m` is scale = d, zero = m + 8 d; Q4_0's `w = d * (q - 8)` is scale = d, zero = 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dflash_robot.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "int8", "int4", "gguf")
GROUP = 32  # int4 group size along K (GGUF's block size)
Linear = Callable[[torch.Tensor], torch.Tensor]


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


K_CHUNK = 512  # oneDNN's fp32/bf16 products were row-invariant up to K = 768 here, not at K = 1536


def _k_split(weight: torch.Tensor, bias: torch.Tensor | None, make: Callable[..., Linear]) -> Linear:
    """A product whose rows do not depend on how many rows share the call: K above K_CHUNK is
    cut into chunks multiplied separately and summed in a fixed order (same bytes read)."""
    k = weight.shape[1]
    if k <= K_CHUNK:
        return make(weight, bias)
    parts = [make(weight[:, i:i + K_CHUNK], bias if i == 0 else None) for i in range(0, k, K_CHUNK)]
    bounds = list(range(0, k, K_CHUNK))

    def f(x: torch.Tensor) -> torch.Tensor:
        y = parts[0](x[:, :K_CHUNK])
        for p, i in zip(parts[1:], bounds[1:], strict=True):
            y = y + p(x[:, i:i + K_CHUNK])
        return y
    return f


def fp32_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    from dflash_robot.targets.fastpath import linear_fn

    return _k_split(weight.float(), bias, lambda w, b: linear_fn(w.contiguous(), None if b is None else b.float()))


def bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return _k_split(weight, bias, _bf16_linear)


def _bf16_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    w = weight.to(torch.bfloat16).contiguous()
    b = None if bias is None else bias.float()
    if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return lambda x: _bias(torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [],
                                                                  "").float(), b)
    return lambda x: _bias(F.linear(x.to(torch.bfloat16), w).float(), b)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None, native: bool = False) -> Linear:
    """Per-output-channel symmetric int8 of `weight` [N, K]; `native`: the kernel's bf16 output,
    not converted to fp32 (for the fused kernels, which read bf16 directly)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    s = scale.to(torch.bfloat16)
    b = None if bias is None else bias.float()
    if native:
        return lambda x: _bias(torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, s), b)
    return lambda x: _bias(torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, s).float(), b)


@dataclass
class Int4Weight:
    """q int32 [N, K] in 0..15, scale and zero fp32 [N, K / GROUP]: w = (q - 8) * scale + zero."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        s = self.scale.repeat_interleave(GROUP, dim=1)
        z = self.zero.repeat_interleave(GROUP, dim=1)
        return (self.q.float() - 8) * s + z

    def rows(self, index: torch.Tensor | slice) -> Int4Weight:
        return Int4Weight(self.q[index], self.scale[index], self.zero[index])

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Asymmetric min/max int4 in groups of 32 along K (the form of GGUF's Q4_1)."""
    n, k = weight.shape
    if k % GROUP:
        raise ConfigError(f"int4 needs the input width to be a multiple of {GROUP}, got {k}")
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return Int4Weight(q, scale, lo + 8 * scale)


def _amx_ops(shape: torch.Size) -> Any:
    """The fused kernels where their AMX products run here and take a weight of `shape` [N, K]
    (whole 16-column blocks, 32-wide groups); else None."""
    from dflash_robot.targets import kernels

    n, k = shape
    return kernels.amx() if n % 16 == 0 and k % GROUP == 0 else None


def int4_linear(w4: Int4Weight, bias: torch.Tensor | None, native: bool = False, amx: bool = True) -> Linear:
    """`native`: the kernel's bf16 output, not converted to fp32 (as `int8_linear`).

    On a CPU with AMX (`kernels.amx()`) the product is the fused kernels' `q4_mm`: the same weights,
    the same bf16 scales and offsets, each group's products exact and summed in fp32, and a cost
    that barely grows with the rows (16 rows ~1.8x one row, against ~5x for torch's kernel).
    Without `native` its output is fp32 straight from the accumulators. Either kernel computes a
    row the same way however many rows share the call; one engine uses one of them throughout.
    `amx=False` (an engine with its fused kernels turned off) keeps torch's kernel."""
    ops = _amx_ops(w4.q.shape) if amx else None
    if ops is not None:
        packed4 = ops.q4_pack(w4.q.to(torch.int32).contiguous(), w4.scale.float().contiguous(),
                              w4.zero.float().contiguous())
        b4 = None if bias is None else bias.float()
        return lambda x: _bias(ops.q4_mm(x.to(torch.bfloat16).contiguous(), packed4, native), b4)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.q.contiguous(), 2)
    sz = torch.stack([w4.scale.t(), w4.zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/G, N, 2]
    b = None if bias is None else bias.float()
    if native:
        return lambda x: _bias(torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP, sz), b)
    return lambda x: _bias(torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, GROUP,
                                                                      sz).float(), b)


@dataclass(frozen=True)
class Int8GroupWeight:
    """q int8 [N, K], scale fp32 [N, K / GROUP]: w = q * scale (GGUF's Q8_0)."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        q, s = (self.q, self.scale) if rows is None else (self.q[rows], self.scale[rows])
        return q.float() * s.repeat_interleave(GROUP, dim=1)


def q8_linear(w8: Int8GroupWeight, bias: torch.Tensor | None, native: bool = False) -> Linear | None:
    """The fused kernels' `q8_mm` on AMX: x (rounded to bf16, as the bf16 head rounds it) times the
    exact int8 weight, each group's products exact, summed in fp32, then scaled; its cost barely
    grows with the rows. None where AMX is not available here (`kernels.amx()`) or the shape is not
    whole 16-column blocks and 32-wide groups."""
    ops = _amx_ops(w8.q.shape)
    if ops is None:
        return None
    packed = ops.q8_pack(w8.q.contiguous(), w8.scale.float().contiguous())
    b = None if bias is None else bias.float()
    return lambda x: _bias(ops.q8_mm(x.to(torch.bfloat16).contiguous(), packed, native), b)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str, native: bool = False,
                amx: bool = True) -> Linear:
    """A product with `weight` [N, K] at `precision` ("gguf" layers are built by `GGUFLayerWeights`).
    Its output is fp32, or with `native` the kernel's own dtype (bf16 for int8 and int4). `amx`:
    int4 may run on the fused kernels' AMX product (`int4_linear`)."""
    if precision == "fp32":
        return fp32_linear(weight, bias)
    if precision == "bf16":
        return bf16_linear(weight, bias)
    if precision == "int8":
        return int8_linear(weight, bias, native)
    if precision == "int4":
        return int4_linear(quantize_int4(weight), bias, native, amx)
    raise ConfigError(f"make_linear: unsupported precision {precision!r}")


# --- GGUF blocks ----------------------------------------------------------------------

def gguf_int4(raw: np.ndarray, qtype: str, n: int, k: int) -> Int4Weight | None:
    """A Q4_0 / Q4_1 tensor's raw blocks (uint8 [N, K / 32 * bytes]) -> its exact int4 form;
    None for other types. Block layouts (ggml): Q4_0 = fp16 d, 16 bytes of nibbles;
    Q4_1 = fp16 d, fp16 m, 16 bytes; element j < 16 is the low nibble of byte j, 16 + j the high."""
    if qtype not in ("Q4_0", "Q4_1"):
        return None
    size = 18 if qtype == "Q4_0" else 20
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if qtype == "Q4_1" else None
    qs = blocks[..., size - 16:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k).astype(np.int32)
    scale = torch.from_numpy(d)
    zero = torch.zeros_like(scale) if m is None else torch.from_numpy(m) + 8 * scale
    return Int4Weight(torch.from_numpy(q), scale, zero)


def gguf_q8_0(raw: np.ndarray, qtype: str, n: int, k: int) -> Int8GroupWeight | None:
    """A Q8_0 tensor's raw blocks (uint8 [N, K / 32 * 34]: fp16 d, then 32 int8) -> its exact form;
    None for other types."""
    if qtype != "Q8_0":
        return None
    blocks = np.ascontiguousarray(raw).reshape(n, k // GROUP, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return Int8GroupWeight(torch.from_numpy(q), torch.from_numpy(d))


def unpermute_rows(w: Int4Weight, n_head: int) -> Int4Weight:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`)."""
    n = w.q.shape[0]
    dim = n // n_head // 2
    order = torch.arange(n).view(n_head, dim, 2).transpose(1, 2).reshape(n)
    return w.rows(order)
