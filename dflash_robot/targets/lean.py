"""A lean target engine for Llama-family decoders, behind the same `TargetAdapter` interface.

Why: on this project's CPUs most of a Hugging Face forward is not the model's arithmetic.
For SmolLM2-135M in fp32 (2 threads) one HF decode step costs ~90 ms while the weights it
must read (~540 MB) take ~30 ms at the measured bandwidth; docs/ARCHITECTURE.md has the
side-by-side figures. This module runs the same computation with:

- fused projections: one `[q; k; v]` product and one `[gate; up]` product per layer,
  every weight pre-packed for oneDNN (`fastpath.linear_fn`) once, at construction;
- a preallocated KV cache per layer (`[kv_heads, capacity, head_dim]`, grown by doubling),
  written in place, so a rollback or crop is just a new length: nothing is copied or freed;
- grouped-query attention as one call per layer with the query heads of a group stacked
  along the sequence axis (no K/V head expansion), no mask at all for q = 1, computed in
  float64 so that every query row is bit-identical however many rows share the call (`_attend`);
- RoPE tables computed once from the model's own `rotary_emb` (its `inv_freq` and
  `attention_scaling`, so the static scalings "default", "linear" and "llama3" are exact);
- tapped features taken straight from the residual stream, no `output_hidden_states` tuple.

Supported: `llama`, `qwen2` and `qwen3` (Q/K RMSNorm) text decoders with full attention,
SiLU MLPs and static RoPE. `supports(model)` says why a model is not; `make_target_adapter`
falls back to `HFTargetAdapter` for those. It computes what the HF forward computes, in the
same dtype, with a different operation order: logits agree to float rounding (tested), not
bit for bit, and the DFlash guarantee holds against this engine's own greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_robot.errors import UnsupportedModelError
from dflash_robot.targets.base import ChunkedForwardAdapter, PositionCache, TargetOutput

LEAN_MODEL_TYPES = ("llama", "qwen2", "qwen3")
_STATIC_ROPE = ("default", "linear", "llama3")
KERNEL_SLOTS = 64  # the fused attention's slot block (SLOTS in csrc/lean_ops.cpp): capacities are multiples


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def unsupported_reason(model: Any) -> str | None:
    """None when the lean engine runs `model` exactly; otherwise why not."""
    cfg = _text_config(model)
    mt = getattr(cfg, "model_type", None)
    if mt not in LEAN_MODEL_TYPES:
        return f"model type {mt!r} (lean engine: {', '.join(LEAN_MODEL_TYPES)})"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return f"{type(model).__name__} lacks the usual .model.layers / .model.rotary_emb"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(cfg, "use_sliding_window", False):
        return "sliding-window layers"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in _STATIC_ROPE:
        return f"RoPE type {rope_type!r} (lean engine: {', '.join(_STATIC_ROPE)})"
    if model.get_output_embeddings() is None:
        return "no output head"
    return None


def supports(model: Any) -> bool:
    return unsupported_reason(model) is None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [nkv, M, d], k/v [nkv, S, d], mask bool [M, S] | None -> [nkv, M, d], in float64.

    Why float64: a query row must come out bit-identical whether it is verified with 15
    others or decoded alone, or DFlash's output could drift from the same engine's own greedy
    decoding. SDPA's fp32 kernels are not row-invariant (their blocking depends on M); after
    bf16 rounding of the next product's input, a last-bit difference grew to 0.44 in the
    logits of SmolLM2 at precision gguf. In float64 the rows differ by ~1e-16 and round to the
    same fp32 values (measured: 0.0 difference; docs/ARCHITECTURE.md). The cache itself stays
    in the model's dtype: a float64 cache removed the per-step conversions but doubled the bytes
    attention reads, and measured slower at 1024 tokens of context (13.7 against 12.3 ms a step)."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double()).to(q.dtype)


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies for the "default" type, as transformers computes them, on the
    CPU whatever the default device (a meta-device arange imports torch._dynamo: 0.6 s of a start)."""
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    return 1.0 / (theta ** exps)


def rope_tables(inv_freq: torch.Tensor, scale: float, n: int, dtype: torch.dtype, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, D] for positions 0..n-1, with rotate_half's sign folded into sin (for `rope`)."""
    freqs = torch.arange(n, dtype=torch.float32, device=device)[:, None] * inv_freq.to(device, torch.float32)[None]
    ang = torch.cat([freqs, freqs], dim=-1)
    half = ang.shape[-1] // 2
    sin = (ang.sin() * scale).to(dtype)
    return (ang.cos() * scale).to(dtype), torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's sign already in `sin` (`rope_tables`):
    [-x2, x1] * [s1, s2] == [x2, x1] * [-s1, s2] exactly, and [x2, x1] is one roll."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class _Layer:
    __slots__ = ("ln1", "ln2", "qkv", "o", "gate_up", "down", "q_norm", "k_norm")

    def __init__(self, index: int, layer: Any, build: Callable[..., Callable]):
        """`build(index, part, weights, bias)` makes the product of one fused part."""
        a, m = layer.self_attn, layer.mlp
        biases = [getattr(a, n).bias for n in ("q_proj", "k_proj", "v_proj")]
        b = torch.cat([x.detach() for x in biases]) if all(x is not None for x in biases) else None  # type: ignore[misc]
        self.qkv = build(index, "qkv", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], b)
        self.o = build(index, "o", [a.o_proj.weight], None if a.o_proj.bias is None else a.o_proj.bias.detach())
        self.gate_up = build(index, "gate_up", [m.gate_proj.weight, m.up_proj.weight], None)
        self.down = build(index, "down", [m.down_proj.weight], None)
        self.ln1 = layer.input_layernorm.weight.detach()
        self.ln2 = layer.post_attention_layernorm.weight.detach()
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.q_norm = None if qn is None else qn.weight.detach()
        self.k_norm = None if kn is None else kn.weight.detach()


class LeanTargetAdapter(PositionCache, ChunkedForwardAdapter):
    """`TargetAdapter` over a lean forward of a Llama/Qwen2/Qwen3 model (see module doc);
    `prefill` and `verify` come from `ChunkedForwardAdapter`, over `_forward` below.

    The HF model stays referenced as `.model` (its embedding and the comparison runs in
    `bench` use it); the engine keeps its own fused, packed copies of the layer weights.
    """

    eos_token_ids: set[int] | None = None  # read from the snapshot's configs (`from_snapshot`); else None

    def __init__(self, model: Any, initial_capacity: int = 512, precision: str = "fp32",
                 gguf_file: str | None = None, kernels: bool = True):
        """`precision` (`targets/quant.py`): how the layers' weights are stored and multiplied;
        "gguf" takes them from `gguf_file`, the GGUF the model was loaded from."""
        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"lean engine cannot run {type(model).__name__}: {reason}")
        from dflash_robot.targets.quant import check_precision, make_linear, q8_linear

        self.precision = check_precision(precision)
        if precision != "fp32" and model.get_input_embeddings().weight.dtype != torch.float32:
            raise UnsupportedModelError(f"precision {precision!r} quantizes an fp32 model; load the target in fp32")
        cfg = _text_config(model)
        self._model: Any = model.eval()
        self._load_model: Callable[[], Any] | None = None  # set by `from_snapshot`
        self.config = cfg
        emb: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[assignment]
        self.embed = emb.detach()
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(emb.shape[0])
        self.dtype: torch.dtype = emb.dtype
        self.device: torch.device = emb.device
        self.max_length: int | None = getattr(cfg, "max_position_embeddings", None)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        inner = model.model  # type: ignore[union-attr]
        from dflash_robot.targets import kernels as fused

        self._ops = fused.for_engine(self.device, self.dtype) if kernels else None
        build, gguf = _layer_builder(precision, gguf_file, self.n_heads, self.n_kv, native=self._ops is not None)
        self.layers = [_Layer(i, layer, build) for i, layer in enumerate(inner.layers)]
        self.final_norm = inner.norm.weight.detach()
        head = model.get_output_embeddings()
        head_w, head_b = head.weight.detach(), None if head.bias is None else head.bias.detach()
        # "gguf": the file's own Q8_0 head where AMX multiplies it (half the bytes of bf16, exact
        # weights); else bf16 below fp32 (int4 heads lose top-1 agreement)
        w8 = gguf.head(head_w) if gguf is not None and self._ops is not None else None
        q8 = q8_linear(w8, head_b) if w8 is not None else None
        self.head_kind = "q8_0" if q8 is not None else {"fp32": "fp32", "int8": "int8"}.get(precision, "bf16")
        self._head_module = _HeadModule(head_w, head_b, (lambda w, b: q8) if q8 is not None else
                                        (lambda w, b: make_linear(w, b, self.head_kind)))
        rot = inner.rotary_emb
        self._inv_freq = rot.inv_freq.detach().to(torch.float32)
        self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self._capacity = 0
        self._initial_capacity = max(16, int(initial_capacity))
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._cos = self._sin = torch.empty(0)
        self._len = 0
        self._bf16_in = precision != "fp32"  # the products' input dtype: bf16 below fp32
        # the fused attention keeps K transposed, [kv_heads, head_dim, capacity] (see csrc/lean_ops.cpp)
        self._k_slot_dim = 2 if self._ops is not None else 1
        self._ensure_capacity(self._initial_capacity)

    @classmethod
    def from_snapshot(cls, snapshot: Any, precision: str = "fp32", gguf_file: str | None = None,
                      load_model: Callable[[], Any] | None = None, initial_capacity: int = 512
                      ) -> LeanTargetAdapter:
        """The engine built from a converted snapshot without transformers (`snapshot.py`): a
        `SnapshotModel` or its directory. `load_model()` gives the transformers model when `.model`
        is first read."""
        from dflash_robot.targets.snapshot import SnapshotModel

        snap = snapshot if isinstance(snapshot, SnapshotModel) else SnapshotModel(Path(snapshot))
        adapter = cls(snap, initial_capacity, precision, gguf_file)
        adapter._model, adapter._load_model = None, load_model
        adapter.eos_token_ids = snap.eos_token_ids()
        return adapter

    @property
    def model(self) -> Any:
        """The transformers model (loaded on first use when the engine came from a snapshot)."""
        if self._model is None:
            if self._load_model is None:
                raise UnsupportedModelError("this lean engine was built from a snapshot without a model loader")
            self._model = self._load_model().eval()
        return self._model

    @property
    def fused_kernels(self) -> bool:
        """Whether the forward runs the fused CPU kernels (`kernels.py`) or the torch path."""
        return self._ops is not None

    # -- cache ---------------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self._capacity:
            return
        cap = max(needed, 2 * self._capacity, self._initial_capacity)
        if self.max_length is not None:
            cap = min(cap, max(self.max_length, needed))
        if self._ops is not None:  # the fused attention reads whole 64-slot blocks (csrc/lean_ops.cpp)
            cap = -(-cap // KERNEL_SLOTS) * KERNEL_SLOTS
        shape = (self.n_kv, cap, self.head_dim)
        k_shape = (self.n_kv, self.head_dim, cap) if self._ops is not None else shape
        new_k = [torch.empty(k_shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        new_v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        kd = self._k_slot_dim
        for old, new in zip(self._k, new_k, strict=False):  # none at first
            new.narrow(kd, 0, self._len).copy_(old.narrow(kd, 0, self._len))
        for old, new in zip(self._v, new_v, strict=False):
            new[:, :self._len] = old[:, :self._len]
        self._k, self._v = new_k, new_v
        cos, sin = rope_tables(self._inv_freq, self._rope_scale, cap, self.dtype, self.device)
        # positions already in the table keep their values: torch's sin/cos may round a position
        # differently in a table of another length (vectorized body against scalar tail), and a
        # verify that crosses the growth point must use what single steps used
        kept = self._cos.shape[0] if self._cos.dim() == 2 else 0
        if kept:
            cos[:kept], sin[:kept] = self._cos, self._sin
        self._cos, self._sin = cos, sin
        self._capacity = cap

    def reset(self) -> None:
        self._len = 0

    # -- forward -------------------------------------------------------------------------
    def _move_slots(self, base: int, kept_nodes: list[int]) -> None:
        src = torch.tensor(kept_nodes, device=self.device) + base
        n = len(kept_nodes)
        kd = self._k_slot_dim
        for buf in self._k:  # index_select copies first: no overlap hazard
            buf.narrow(kd, base, n).copy_(buf.index_select(kd, src))
        for buf in self._v:
            buf[:, base:base + n] = buf[:, src]

    def _forward(self, ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                 logits_to_keep: int = 0, positions: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """ids [T] -> logits [T or logits_to_keep, V], features [T, n*H]; appends T to the cache
        (slots start..start+T-1; RoPE at `positions`, default the same numbers)."""
        if self._ops is not None:
            return self._forward_fused(ids, tap_layer_ids, logits_to_keep, positions, tree_mask)
        t, start = ids.shape[0], self._len
        end = start + t
        self._ensure_capacity(end)
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        if positions is None:
            cos = self._cos[start:end][:, None, :]  # [T, 1, D]
            sin = self._sin[start:end][:, None, :]
        else:
            cos = self._cos[positions][:, None, :]
            sin = self._sin[positions][:, None, :]
        if tree_mask is not None:  # every node sees the committed cache and its own ancestors
            seen = torch.ones(t, start, dtype=torch.bool, device=self.device)
            mask = torch.cat([seen, tree_mask], dim=1).repeat(g, 1)  # [g*T, end]
        elif t == 1:
            mask = None
        else:  # query row (group, i) sees keys 0 .. start + i
            key_pos = torch.arange(end, device=self.device)
            causal = key_pos[None, :] <= (start + torch.arange(t, device=self.device))[:, None]  # [T, end]
            mask = causal.repeat(g, 1)  # [g*T, end]
        taps = set(tap_layer_ids or ())
        feats: dict[int, torch.Tensor] = {}
        x = F.embedding(ids, self.embed)  # [T, H]
        for i, layer in enumerate(self.layers):
            h = _rms(x, layer.ln1, self.eps)
            qkv = layer.qkv(h)
            if layer.q_norm is None and layer.k_norm is None:  # RoPE on q and k heads in one pass
                qk = rope(qkv[:, :(nh + nkv) * d].view(t, nh + nkv, d), cos, sin)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                q, k = qkv[:, :nh * d].view(t, nh, d), qkv[:, nh * d:(nh + nkv) * d].view(t, nkv, d)
                if layer.q_norm is not None:
                    q = _rms(q, layer.q_norm, self.eps)
                if layer.k_norm is not None:
                    k = _rms(k, layer.k_norm, self.eps)
                q, k = rope(q, cos, sin), rope(k, cos, sin)
            v = qkv[:, (nh + nkv) * d:].view(t, nkv, d)
            kc, vc = self._k[i], self._v[i]
            kc[:, start:end] = k.transpose(0, 1)
            vc[:, start:end] = v.transpose(0, 1)
            # [T, nh, d] -> [nkv, g*T, d]: the g query heads of a KV head stacked along rows
            qh = q.reshape(t, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * t, d)
            o = _attend(qh, kc[:, :end], vc[:, :end], mask)
            o = o.view(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, nh * d)
            x = x + layer.o(o)
            h = _rms(x, layer.ln2, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
            if i in taps and i != self.num_layers - 1:
                feats[i] = x
        x = _rms(x, self.final_norm, self.eps)
        if self.num_layers - 1 in taps:  # hidden_states[L] comes after the final norm
            feats[self.num_layers - 1] = x
        self._len = end
        rows = x if logits_to_keep == 0 else x[-logits_to_keep:]
        logits = self._head_module(rows)
        features = torch.cat([feats[j] for j in tap_layer_ids], dim=-1) if tap_layer_ids else None
        return TargetOutput(logits=logits, features=features)

    def _forward_fused(self, ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None, logits_to_keep: int,
                       positions: torch.Tensor | None, tree_mask: torch.Tensor | None) -> TargetOutput:
        """`_forward` with the fused kernels (`kernels.py`): per layer four products and four calls."""
        ops, t, start, eps, bf = self._ops, ids.shape[0], self._len, self.eps, self._bf16_in
        assert ops is not None
        end = start + t
        self._ensure_capacity(end)
        if positions is not None:
            positions = positions.to(torch.int64).contiguous()
        if tree_mask is not None:
            tree_mask = tree_mask.to(torch.bool).contiguous()
        taps = set(tap_layer_ids or ())
        feats: dict[int, torch.Tensor] = {}
        last = self.num_layers - 1
        x = F.embedding(ids, self.embed)  # [T, H], updated in place below
        h = ops.rms_norm(x, self.layers[0].ln1, eps, bf)
        for i, layer in enumerate(self.layers):
            a = ops.attention(layer.qkv(h), self._k[i], self._v[i], self._cos, self._sin, start, self.n_heads,
                              positions, tree_mask, layer.q_norm, layer.k_norm, eps, bf)
            h = ops.add_rms_norm(x, layer.o(a), layer.ln2, eps, bf)
            nxt = self.layers[i + 1].ln1 if i < last else self.final_norm
            h = ops.add_rms_norm(x, layer.down(ops.silu_mul(layer.gate_up(h), bf)), nxt, eps,
                                 bf if i < last else False)
            if i in taps and i != last:
                feats[i] = x.clone()
        if last in taps:  # hidden_states[L] comes after the final norm
            feats[last] = h
        self._len = end
        rows = h if logits_to_keep == 0 else h[-logits_to_keep:]
        logits = self._head_module(rows)
        features = torch.cat([feats[j] for j in tap_layer_ids], dim=-1) if tap_layer_ids else None
        return TargetOutput(logits=logits, features=features)

    def input_embedding_weight(self) -> torch.Tensor:
        return self.embed

    def output_head(self) -> nn.Module:
        return self._head_module


def _layer_builder(precision: str, gguf_file: str | None, n_heads: int, n_kv: int,
                   native: bool = False) -> tuple[Callable[..., Callable], Any]:
    """-> (build(index, part, hf_weights, bias): one fused product at `precision` (`native`: for the
    fused kernels, outputs in the kernel's dtype and int4 on their AMX product where there is one),
    the `GGUFLayerWeights` for "gguf" else None)."""
    from dflash_robot.targets.quant import make_linear

    if precision != "gguf":
        return (lambda i, part, ws, b: make_linear(torch.cat([w.detach() for w in ws]), b, precision, native,
                                                   amx=native)), None
    if gguf_file is None:
        raise UnsupportedModelError("precision 'gguf' needs the target to be loaded from a GGUF file")
    from dflash_robot.targets.gguf_weights import GGUFLayerWeights

    weights = GGUFLayerWeights(gguf_file, n_heads, n_kv)
    return (lambda i, part, ws, b: weights.build(i, part, ws, b, native)), weights


class _HeadModule(nn.Module):
    """The target's output head as a module (the draft's proposer calls it), packed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 linear_fn: Callable[[torch.Tensor, torch.Tensor | None], Callable]):
        super().__init__()
        self.weight = weight  # plain tensor: reads like nn.Linear.weight for shape checks
        self.out_features, self.in_features = weight.shape
        self._fn = linear_fn(weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)

