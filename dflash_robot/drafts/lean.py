"""The draft's inference forward with fewer, fused operations (`LeanDraftForward`).

`DFlashDraft.forward` (`model.py`) is the reference: module per module, in z-lab's layout, used
by training, export and the parity tests. At inference its cost on this project's CPUs was
mostly not arithmetic: the shipped 3-layer SmolLM2 draft took ~3 ms per block-4 proposal, a
third of a target decode step, for ~30 MB of weights (measured 2026-11-30; quantizing its
linears to bf16, int8 or int4 changed nothing, which says the time is per-operation overhead).
This forward computes the same function with:

- one product per layer for q, k and v of the context rows and the block rows together
  (`[ctx; norm(h)] @ [Wq; Wk; Wv]^T`; the context rows' q columns are unused);
- the q and k head norms as one weightless RMS norm times a stacked per-head weight, and RoPE
  on q and k heads in one pass (positions start .. start + c + q - 1 are one contiguous range);
- one `[gate; up]` product per layer, fp32 weights pre-packed for oneDNN (`fastpath.linear_fn`);
- its own context K/V buffers, into which the block's K/V are also written (past the committed
  length, so they are simply overwritten next step): attention reads one slice, no concatenation;
- RoPE tables computed once for the buffers' capacity.

Same math as the module, different operation order: logits agree to float rounding (tested).
The target still verifies every token, so the output of generation does not depend on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.targets.lean import KERNEL_SLOTS, rope, rope_tables

Linear = Callable[[torch.Tensor], torch.Tensor]


def _fused(weights: list[torch.Tensor], precision: str, amx: bool = True) -> Linear:
    w = torch.cat([w.detach() for w in weights]).contiguous()
    if precision == "fp32" or w.dtype != torch.float32 or w.device.type != "cpu":
        from dflash_robot.targets.fastpath import linear_fn

        return linear_fn(w)  # fp32 packed for oneDNN on CPU, else F.linear in the draft's own dtype
    from dflash_robot.targets.quant import make_linear

    return make_linear(w, None, precision, amx=amx)


class _Layer:
    __slots__ = ("ln1", "ln2", "qkv", "o", "gate_up", "down", "qk_norm")

    def __init__(self, layer: Any, precision: str, amx: bool = True):
        a, m = layer.self_attn, layer.mlp
        self.qkv = _fused([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], precision, amx)
        self.o = _fused([a.o_proj.weight], precision, amx)
        self.gate_up = _fused([m.gate_proj.weight, m.up_proj.weight], precision, amx)
        self.down = _fused([m.down_proj.weight], precision, amx)
        self.ln1 = layer.input_layernorm.weight.detach()
        self.ln2 = layer.post_attention_layernorm.weight.detach()
        nh, nkv = a.num_heads, a.num_kv_heads
        self.qk_norm = torch.cat([a.q_norm.weight.detach()[None].expand(nh, -1),
                                  a.k_norm.weight.detach()[None].expand(nkv, -1)])  # [nh + nkv, d]


class LeanDraftForward:
    """`DFlashDraft.forward` at inference, with its own context cache (module doc).

    `forward(noise [q, H], features [c, F])` attends the block to everything committed so far
    plus the c new context rows, commits those c rows and returns the final-normed block
    states [q, H]. `reset()` starts a new sequence."""

    @staticmethod
    def unsupported_reason(draft: DFlashDraft) -> str | None:
        """None when this forward computes what the module computes; otherwise why not (the
        proposer then runs the module)."""
        from dflash_robot.drafts.model import rope_type

        m: Any = draft
        if any(getattr(layer.self_attn, n).bias is not None for layer in m.layers
               for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "attention biases"
        if getattr(draft.config, "hidden_act", "silu") != "silu":
            return f"activation {draft.config.hidden_act!r}"
        if rope_type(draft.config) != "default":
            return f"RoPE type {rope_type(draft.config)!r}"
        return None

    def __init__(self, draft: DFlashDraft, precision: str = "fp32", capacity: int = 1024, kernels: bool = True):
        """`precision` of the products' weights (`targets/quant.py`: fp32, bf16, int8, int4) for an
        fp32 draft on CPU; other drafts multiply in their own dtype. `kernels`: run the target
        engine's fused CPU kernels (`targets/kernels.py`) between the products when they load."""
        reason = self.unsupported_reason(draft)
        if reason is not None:
            raise ValueError(f"LeanDraftForward: {reason}")
        m: Any = draft  # its submodules, untyped
        cfg = draft.config
        attn = m.layers[0].self_attn
        self.nh, self.nkv, self.d = int(attn.num_heads), int(attn.num_kv_heads), int(attn.head_dim)
        self.eps = float(cfg.rms_norm_eps)
        self.precision = precision
        self.fc = _fused([draft.fc.weight], precision, kernels)
        self.hidden_norm = draft.hidden_norm.weight.detach()
        self.norm = draft.norm.weight.detach()
        self.layers = [_Layer(layer, precision, kernels) for layer in m.layers]
        p = draft.fc.weight
        self.dtype, self.device = p.dtype, p.device
        rot = m.rotary_emb
        self._inv_freq = rot.inv_freq.detach().to(device=self.device, dtype=torch.float32)
        self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        from dflash_robot.targets import kernels as fused

        self._ops: Any = fused.for_engine(self.device, self.dtype) if kernels else None
        self._bf16_in = precision != "fp32"  # the products' input dtype
        self._qn = [layer.self_attn.q_norm.weight.detach().contiguous() for layer in m.layers]
        self._kn = [layer.self_attn.k_norm.weight.detach().contiguous() for layer in m.layers]
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)
        self._capacity = 0
        self.length = 0  # committed context rows
        self._ensure_capacity(capacity)

    def reset(self) -> None:
        self.length = 0

    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        cap = max(needed, 2 * self._capacity)
        k_shape: tuple[int, ...]
        v_shape: tuple[int, ...]
        if self._ops is not None:  # the fused attention: K transposed, capacity in whole 64-slot blocks
            cap = -(-cap // KERNEL_SLOTS) * KERNEL_SLOTS
            k_shape, v_shape = (self.nkv, self.d, cap), (self.nkv, cap, self.d)
        else:
            k_shape = v_shape = (1, self.nkv, cap, self.d)
        new_k = [torch.empty(k_shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        new_v = [torch.empty(v_shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        n = self.length  # dim 2 is the slot axis of both K layouts; V's slots are its second-last axis
        for old, new in zip(self._k, new_k, strict=False):  # none at first
            new[:, :, :n] = old[:, :, :n]
        for old, new in zip(self._v, new_v, strict=False):
            new[..., :n, :] = old[..., :n, :]
        self._k, self._v = new_k, new_v
        cos, sin = rope_tables(self._inv_freq, self._rope_scale, cap, self.dtype, self.device)
        if self._ops is not None:
            self._cos, self._sin = cos.contiguous(), sin.contiguous()  # [cap, d]
        else:
            self._cos, self._sin = cos[:, None, :], sin[:, None, :]  # [cap, 1, d]
        self._capacity = cap

    @torch.inference_mode()
    def forward(self, noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return self._forward_fused(noise, features)
        c, q = features.shape[0], noise.shape[0]
        start = self.length
        end = start + c + q
        self._ensure_capacity(end)
        nh, nkv, d, eps = self.nh, self.nkv, self.d, self.eps
        cos, sin = self._cos[start:end], self._sin[start:end]  # positions start .. end - 1
        ctx = F.rms_norm(self.fc(features), self.hidden_norm.shape, self.hidden_norm, eps)  # [c, H]
        h = noise
        for i, layer in enumerate(self.layers):
            rows = torch.cat([ctx, F.rms_norm(h, layer.ln1.shape, layer.ln1, eps)])  # [c + q, H]
            y = layer.qkv(rows)
            qk = F.rms_norm(y[:, :(nh + nkv) * d].view(c + q, nh + nkv, d), (d,), None, eps) * layer.qk_norm
            qk = rope(qk, cos, sin)
            kc, vc = self._k[i], self._v[i]
            kc[0, :, start:end] = qk[:, nh:].transpose(0, 1)
            vc[0, :, start:end] = y[:, (nh + nkv) * d:].view(c + q, nkv, d).transpose(0, 1)
            qh = qk[c:, :nh].transpose(0, 1)[None]  # [1, nh, q, d]
            o = F.scaled_dot_product_attention(qh, kc[:, :, :end], vc[:, :, :end], scale=d ** -0.5,
                                               enable_gqa=nh != nkv)
            h = h + layer.o(o[0].transpose(0, 1).reshape(q, nh * d))
            gate, up = layer.gate_up(F.rms_norm(h, layer.ln2.shape, layer.ln2, eps)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        self.length = start + c  # the block's own K/V past here are overwritten next step
        return F.rms_norm(h, self.norm.shape, self.norm, eps)

    def _forward_fused(self, noise: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """`forward` on the fused kernels: per layer the [ctx; norm(h)] rows through one q/k/v
        product and one attention call (q/k norms, RoPE, K/V written from slot `length`; every
        row sees all committed context and all c + q new rows, the context rows' own outputs
        unused), then residual + norm, SiLU*up and residual + norm as single calls."""
        ops, eps, bf = self._ops, self.eps, self._bf16_in
        c, q = features.shape[0], noise.shape[0]
        start = self.length
        self._ensure_capacity(start + c + q)
        ctx = ops.rms_norm(self.fc(features).float().contiguous(), self.hidden_norm, eps, bf)  # [c, H]
        see_all = torch.ones(c + q, c + q, dtype=torch.bool)
        h = noise.float().contiguous().clone()  # the block's residual stream, updated in place
        hn = ops.rms_norm(h, self.layers[0].ln1, eps, bf)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            a = ops.attention(layer.qkv(torch.cat([ctx, hn])), self._k[i], self._v[i], self._cos, self._sin, start,
                              self.nh, None, see_all, self._qn[i], self._kn[i], eps, bf)
            hn = ops.add_rms_norm(h, layer.o(a[c:]).contiguous(), layer.ln2, eps, bf)
            nxt = self.layers[i + 1].ln1 if i < last else self.norm
            hn = ops.add_rms_norm(h, layer.down(ops.silu_mul(layer.gate_up(hn), bf)).contiguous(), nxt, eps,
                                  bf if i < last else False)
        self.length = start + c  # the block's own K/V past here are overwritten next step
        return hn
