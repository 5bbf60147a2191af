"""Exportable (static-shape) forms of a target and its draft, for `torch.export` / ExecuTorch.

The design is the ExecuTorch DFlash RFC's (seed 002), with two programs:

- target: `(tokens [q], input_pos [1]) -> (logits [q, V], features [q, n*H])`. The KV cache is
  a mutable buffer indexed by position: a verify writes slots input_pos..input_pos+q-1 and
  each row attends to the slots at or before its own position. Rollback is passing the right
  `input_pos` next time; stale slots past it are never read before being overwritten.
- draft: `(tokens [q], hidden [q, n*H], hidden_len [1], input_pos [1]) -> logits [q-1, V']`.
  Unlike the RFC's reset-every-round draft cache, the draft keeps the K/V of every committed
  context token by position as well (like our eager draft and z-lab's), so at the exported block
  size it proposes what the eager draft proposes (a shorter block is padded with mask tokens,
  which the block's bidirectional attention sees: its drafts may then differ, the output does
  not): rows `hidden[:hidden_len]` are the features committed since the last
  call, at positions input_pos.., and the block sits right after them. The padded rows past
  `hidden_len` are written to slots the next call overwrites, and masked out.

Both have one static block size q, fixed at export; prefill feeds the prompt in chunks of q
(the last one padded), and block size 1 runs the same program with q - 1 padding tokens.
Targets: the lean engine's families (Llama, Qwen2, Qwen3 with full attention), fp32 weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_robot.drafts.model import DFlashDraft
from dflash_robot.targets.lean import rope, rope_tables


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


def _copy_linear(src: nn.Linear, f32: Any) -> nn.Linear:
    lin = nn.Linear(src.in_features, src.out_features, bias=src.bias is not None)
    lin.weight = f32(src.weight)
    if src.bias is not None:
        lin.bias = f32(src.bias)
    return lin


class _Layer(nn.Module):
    """One decoder layer's fp32 weights (separate projections: XNNPACK packs each)."""

    def __init__(self, layer: Any, f32: Any):
        super().__init__()
        a, m = layer.self_attn, layer.mlp
        self.q_proj, self.k_proj = _copy_linear(a.q_proj, f32), _copy_linear(a.k_proj, f32)
        self.v_proj, self.o_proj = _copy_linear(a.v_proj, f32), _copy_linear(a.o_proj, f32)
        self.gate_proj, self.up_proj = _copy_linear(m.gate_proj, f32), _copy_linear(m.up_proj, f32)
        self.down_proj = _copy_linear(m.down_proj, f32)
        self.ln1: torch.Tensor = f32(layer.input_layernorm.weight)
        self.ln2: torch.Tensor = f32(layer.post_attention_layernorm.weight)
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        self.q_norm: torch.Tensor | None = None if qn is None else f32(qn.weight)
        self.k_norm: torch.Tensor | None = None if kn is None else f32(kn.weight)


class ExportableTarget(nn.Module):
    """A Llama/Qwen2/Qwen3 causal LM with a static, position-indexed KV cache and tapped features."""

    cos: torch.Tensor  # [C, d] RoPE tables (buffers)
    sin: torch.Tensor

    def __init__(self, model: Any, tap_layer_ids: tuple[int, ...], max_context: int):
        super().__init__()
        from dflash_robot.errors import UnsupportedModelError
        from dflash_robot.targets.lean import _text_config, unsupported_reason

        reason = unsupported_reason(model)
        if reason is not None:
            raise UnsupportedModelError(f"ExecuTorch export supports the lean engine's families; {reason}")
        cfg = _text_config(model)
        inner = model.model
        self.n_layers = int(cfg.num_hidden_layers)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.taps = tuple(int(i) for i in tap_layer_ids)
        self.max_context = int(max_context)

        def f32(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().to(torch.float32).clone(), requires_grad=False)

        self.embed = f32(model.get_input_embeddings().weight)
        self.layers = nn.ModuleList([_Layer(layer, f32) for layer in inner.layers])
        self.norm = f32(inner.norm.weight)
        head = model.get_output_embeddings()
        self.head = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        tied = head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        self.head.weight = self.embed if tied else f32(head.weight)  # tied: one copy in the program
        if head.bias is not None:
            self.head.bias = f32(head.bias)
        rot = inner.rotary_emb
        cos, sin = rope_tables(rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)), self.max_context,
                               torch.float32, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # one buffer per layer: an in-place write into a slice of one big buffer is functionalized
        # by torch.export into a copy of the whole buffer per layer (measured: 1.07 s a verify)
        shape = (self.n_kv, self.max_context, self.head_dim)
        for i in range(self.n_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_len = tokens.shape[0]
        pos = input_pos + torch.arange(q_len, dtype=torch.long)  # [q]
        nh, nkv, d = self.n_heads, self.n_kv, self.head_dim
        g = nh // nkv
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]  # [q, 1, d]
        slots = torch.arange(self.max_context, dtype=torch.long)
        visible = slots[None, :] <= pos[:, None]  # [q, C]
        written = slots < input_pos + q_len  # [C]
        x = F.embedding(tokens, self.embed)
        feats: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            h = _rms(x, layer.ln1, self.eps)
            q = layer.q_proj(h).view(q_len, nh, d)
            k = layer.k_proj(h).view(q_len, nkv, d)
            v = layer.v_proj(h).view(q_len, nkv, d)
            if layer.q_norm is not None:
                q = _rms(q, layer.q_norm, self.eps)
            if layer.k_norm is not None:
                k = _rms(k, layer.k_norm, self.eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            kc, vbuf = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")  # [nkv, C, d]
            kc.index_copy_(1, pos, k.transpose(0, 1))
            vbuf.index_copy_(1, pos, v.transpose(0, 1))
            # slots past this call's last one may never have been written (ExecuTorch does not
            # serialize a mutated buffer's initial state): a masked score is -inf, but 0 * NaN is NaN
            vc = torch.where(written[None, :, None], vbuf, 0.0)
            qh = q.transpose(0, 1).reshape(nkv, g, q_len, d).reshape(nkv, g * q_len, d)
            s = torch.matmul(qh, kc.transpose(1, 2)) * (d ** -0.5)  # [nkv, g*q, C]
            s = s.masked_fill(~visible.repeat(g, 1)[None], float("-inf"))
            o = torch.matmul(torch.softmax(s, dim=-1), vc)  # [nkv, g*q, d]
            o = o.view(nkv, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, nh * d)
            x = x + layer.o_proj(o)
            h = _rms(x, layer.ln2, self.eps)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
            if i in self.taps and i != self.n_layers - 1:
                feats.append(x)
        x = _rms(x, self.norm, self.eps)
        by_id = dict(zip([t for t in self.taps if t != self.n_layers - 1], feats, strict=True))
        if self.n_layers - 1 in self.taps:
            by_id[self.n_layers - 1] = x
        features = torch.cat([by_id[t] for t in self.taps], dim=-1)
        return self.head(x), features


class _StaticContextCache:
    """The draft layers' `cache` interface over position-indexed buffers of an nn.Module."""

    def __init__(self, owner: ExportableDraft, positions: torch.Tensor):
        self.owner, self.positions = owner, positions

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kc, vc = getattr(self.owner, f"k_cache_{layer}"), getattr(self.owner, f"v_cache_{layer}")  # [Hkv, C, D]
        kc.index_copy_(1, self.positions, k[0])
        vc.index_copy_(1, self.positions, v[0])
        written = (torch.arange(kc.shape[1], dtype=torch.long) <= self.positions[-1])[None, :, None]
        # never-written slots may hold NaN (see ExportableTarget); SDPA adds its mask, NaN + -inf is NaN
        return torch.where(written, kc, 0.0)[None], torch.where(written, vc, 0.0)[None]

    def commit(self) -> None:
        return None


class ExportableDraft(nn.Module):
    """A `DFlashDraft` plus copies of the target's embedding and head rows (the RFC's option A),
    with its context K/V in position-indexed buffers (see the module doc)."""

    def __init__(self, draft: DFlashDraft, embedding: torch.Tensor, head_weight: torch.Tensor,
                 head_bias: torch.Tensor | None, block_size: int, max_context: int):
        super().__init__()
        # a fresh module from the weights: the given draft may carry oneDNN-packed linears
        # (targets/fastpath.py), which neither copy nor export
        fresh = DFlashDraft(draft.config, draft.metadata)
        fresh.load_state_dict({k: v.detach().float() if v.is_floating_point() else v
                               for k, v in draft.state_dict().items()})
        self.draft = fresh.float().eval()
        self.meta = draft.metadata
        self.block_size = int(block_size)
        self.capacity = int(max_context) + self.block_size  # padded context rows may overrun by q - 1
        self.embed = nn.Parameter(embedding.detach().float().clone(), requires_grad=False)
        self.head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=head_bias is not None)
        self.head.weight = nn.Parameter(head_weight.detach().float().clone(), requires_grad=False)
        if head_bias is not None:
            self.head.bias = nn.Parameter(head_bias.detach().float().clone(), requires_grad=False)
        s = self.draft.shape
        shape = (s.num_kv_heads, self.capacity, s.head_dim)
        for i in range(s.num_layers):  # one buffer per layer (see ExportableTarget)
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape))
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape))

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, hidden_len: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        q = tokens.shape[0]
        ctx_pos = input_pos + torch.arange(hidden.shape[0], dtype=torch.long)  # [q]
        end = input_pos + hidden_len  # committed context after this call
        blk_pos = end + torch.arange(q, dtype=torch.long)
        slots = torch.arange(self.capacity, dtype=torch.long)
        mask = torch.cat([(slots < end).expand(q, self.capacity), torch.ones(q, q, dtype=torch.bool)], dim=1)
        noise = F.embedding(tokens, self.embed)[None]
        if self.meta.input_embedding_scale != 1.0:
            noise = noise * self.meta.input_embedding_scale
        d = self.draft
        ctx = d.fuse(hidden[None])
        rope_block = d.rotary_emb(noise, blk_pos[None])
        rope_ctx = d.rotary_emb(noise, ctx_pos[None])
        cache = _StaticContextCache(self, ctx_pos)
        h = noise
        for i, layer in enumerate(d.layers):
            h = layer(h, ctx, rope_block, rope_ctx, cache, i, mask[None, None])
        h = d.norm(h)
        return d.finish_logits(self.head(h[0, 1:]))
