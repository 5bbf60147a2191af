"""The DFlash block-diffusion draft (arXiv 2602.06036, Sec. 3.2) in z-lab's checkpoint format.

A stack of Qwen3-style decoder layers whose attention reads two sources:
- the *context*: target features `hidden_norm(fc(concat_i hidden_states[id_i + 1]))`,
  projected by each layer's own k/v projections (never through its input norm);
- the *block*: `[last token, mask, ..., mask]` embedded with the target's embedding.

Queries come from the block only. Attention is bidirectional over context + block (no
mask), RoPE uses absolute positions, and q/k are RMS-normed before RoPE. Logits come from
the target's lm_head applied to the final-normed block states at positions 1..q-1.

At inference the context K/V of every committed token is kept in a `DraftKVCache`; only
the newly committed context is projected at each step, and the block's own K/V are never
stored, so the cache needs no crop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_robot.drafts.metadata import DraftMetadata

# The draft's layers are Qwen3's (z-lab's checkpoints are Qwen3 configs), written here rather than
# imported from transformers: importing `transformers.models.qwen3.modeling_qwen3` cost ~2.1 s of
# every start (measured with `python -X importtime`, 2026-11-30), longer than loading the models.
# `test_zlab_parity.py` holds them to the reference package's logits (built on transformers' own).
Qwen3Config = Any  # transformers' Qwen3Config, or `DraftConfig` (checkpoint.py) with the same fields


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos/sin [B, T, D] -> x rotated."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Qwen3RMSNorm(nn.Module):
    """transformers' Qwen3RMSNorm: normalized in fp32, then weight * x in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        act = getattr(config, "hidden_act", "silu")
        if act == "silu":
            self.act_fn = F.silu
        else:  # as transformers' Qwen3MLP: its activation table (imported only for these drafts)
            from transformers.activations import ACT2FN

            self.act_fn = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def rope_type(config: Qwen3Config) -> str:
    rope = getattr(config, "rope_parameters", None) or {}
    return str(rope.get("rope_type", rope.get("type", "default")))


class Qwen3RotaryEmbedding(nn.Module):
    """RoPE cos/sin for positions, as transformers' Qwen3RotaryEmbedding computes them for the
    "default" rope type (no scaling); other types use transformers' own (`rotary_embedding`)."""

    inv_freq: torch.Tensor

    def __init__(self, config: Qwen3Config):
        super().__init__()
        rope = getattr(config, "rope_parameters", None) or {}
        base = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
        dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        from dflash_robot.targets.lean import default_inv_freq

        # built on the CPU even inside `torch.device("meta")` (load_draft), then moved to the device
        # the module is being built on (a copy is no factory call)
        inv = default_inv_freq(base, dim).to(torch.get_default_device())
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        with torch.autocast(device_type=x.device.type, enabled=False):  # fp32 under bf16 training too
            freqs = (inv.float() @ position_ids[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


def rotary_embedding(config: Qwen3Config) -> nn.Module:
    if rope_type(config) == "default":
        return Qwen3RotaryEmbedding(config)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding as HFRotary

    return HFRotary(config)


class DraftKVCache:
    """Per-layer context K/V, preallocated and grown by doubling. Shapes [1, Hkv, cap, D]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int = 1024):
        self.shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0  # committed context tokens, equal across layers after a full forward
        self._pending = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [1, Hkv, n, D] after the committed context; return views of all of it."""
        n = k.shape[2]
        end = self.length + n
        if end > self.keys[layer].shape[2]:
            self._grow(layer, end)
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        self._pending = n
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def commit(self) -> None:
        """Called once per forward, after every layer appended the same n tokens."""
        self.length += self._pending
        self._pending = 0

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, layer: int, needed: int) -> None:
        cap = max(needed, 2 * self.keys[layer].shape[2])
        for buf in (self.keys, self.values):
            new = buf[layer].new_empty((*self.shape[:2], cap, self.shape[3]))
            new[:, :, :self.length] = buf[layer][:, :, :self.length]
            buf[layer] = new


class DraftAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def _kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> k, v [B, Hkv, T, D] (k normed then rotated)."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, *rope), v

    def forward(
        self,
        x: torch.Tensor,  # [B, q, H] normed block states
        ctx: torch.Tensor,  # [B, c, H] fused target features (c may be 0)
        rope_block: tuple[torch.Tensor, torch.Tensor],  # cos/sin [B, q, D]
        rope_ctx: tuple[torch.Tensor, torch.Tensor],  # cos/sin [B, c, D]
        cache: DraftKVCache | None = None,
        layer: int = 0,
        mask: torch.Tensor | None = None,  # bool [B or 1, 1, q, c+q], True = visible
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, *rope_block)
        k_ctx, v_ctx = self._kv(ctx, rope_ctx)
        if cache is not None:
            k_ctx, v_ctx = cache.append(layer, k_ctx, v_ctx)
        k_blk, v_blk = self._kv(x, rope_block)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: torch.Tensor, rope_block, rope_ctx,
                cache: DraftKVCache | None, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_block, rope_ctx, cache, layer, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftShape:
    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    fc_in_features: int


class DFlashDraft(nn.Module):
    """The draft's own weights, with z-lab's tensor names. No embedding, no lm_head."""

    d2t: torch.Tensor  # [N] int64, present with a draft vocabulary (metadata.draft_vocab_size)
    t2d: torch.Tensor  # [V] bool

    def __init__(self, config: Qwen3Config, metadata: DraftMetadata):
        super().__init__()
        self.config = config
        self.metadata = metadata
        h = config.hidden_size
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(metadata.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)
        n = metadata.draft_vocab_size
        if n is not None:  # EAGLE-3 / SpecForge convention: target id = d + d2t[d]; t2d marks covered ids
            self.register_buffer("d2t", torch.zeros(n, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """-> target ids [N] of the draft head's rows (sorted), or None for the full vocabulary."""
        if self.metadata.draft_vocab_size is None:
            return None
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_vocab(self, ids: torch.Tensor) -> None:
        """ids [N]: distinct target token ids the draft head covers (stored sorted as d2t/t2d)."""
        ids = ids.unique().sort().values.to(self.d2t.device)
        assert ids.shape == self.d2t.shape, f"expected {self.d2t.shape[0]} ids, got {ids.shape[0]}"
        self.d2t.copy_(ids - torch.arange(ids.shape[0], device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def prompt_extra(self, prompt_ids: torch.Tensor) -> torch.Tensor | None:
        """prompt_ids [P] -> the distinct prompt tokens outside the draft vocabulary, sorted [E]:
        the extra head columns of a `prompt_vocab` draft for that request (None for any other
        draft). A word problem's names and nouns are rare in training text and copied by the
        target; a frequency-ranked vocabulary cannot hold them (docs/TRAINING.md, session 22)."""
        if not self.metadata.prompt_vocab:
            return None
        ids = prompt_ids.to(self.t2d.device).unique()
        return ids[~self.t2d[ids]]

    def head_weight(self, head: nn.Module, extra: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target head's (weight [N, H], bias [N] | None) restricted to the draft vocabulary,
        followed by the rows of `extra` target ids ([N + E, H]) when given."""
        w: torch.Tensor = head.weight  # type: ignore[assignment]
        b: torch.Tensor | None = getattr(head, "bias", None)
        ids = self.vocab_ids
        if ids is None:
            return w, b
        if extra is not None:
            ids = torch.cat([ids, extra.to(ids.device)])
        return w[ids], None if b is None else b[ids]

    @property
    def shape(self) -> DraftShape:
        attn = self.layers[0].self_attn
        assert isinstance(attn, DraftAttention)
        return DraftShape(self.config.hidden_size, len(self.layers), attn.num_kv_heads,
                          attn.head_dim, self.config.vocab_size, self.fc.in_features)

    def new_cache(self, capacity: int = 1024) -> DraftKVCache:
        p = self.fc.weight
        s = self.shape
        return DraftKVCache(s.num_layers, s.num_kv_heads, s.head_dim, p.dtype, p.device, capacity)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, c, n_ids*H_target] -> fused context [B, c, H]."""
        return self.hidden_norm(self.fc(features))

    def forward(
        self,
        noise: torch.Tensor,  # [B, q, H] block embeddings
        features: torch.Tensor,  # [B, c, n_ids*H] target features
        block_positions: torch.Tensor,  # [B, q] int64
        ctx_positions: torch.Tensor,  # [B, c] int64
        cache: DraftKVCache | None = None,
        mask: torch.Tensor | None = None,  # bool [B|1, 1, q, c+q] (training); None = all visible
    ) -> torch.Tensor:
        """-> final-normed block states [B, q, H]."""
        ctx = self.fuse(features)
        rope_block = self.rotary_emb(noise, block_positions)
        rope_ctx = self.rotary_emb(noise, ctx_positions)
        h = noise
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, rope_block, rope_ctx, cache, i, mask)
        if cache is not None:
            cache.commit()
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, head: nn.Module, extra: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., H] -> draft logits [..., V] through the target's lm_head, or [..., N]
        over the draft vocabulary (`vocab_ids`) when the draft has one, [..., N + E] with a
        request's `extra` ids (`prompt_extra`) appended."""
        if self.metadata.draft_vocab_size is None:
            out = head(hidden)
        else:
            w, b = self.head_weight(head, extra)
            out = F.linear(hidden, w.to(hidden.dtype), None if b is None else b.to(hidden.dtype))
        return self.finish_logits(out)

    def finish_logits(self, out: torch.Tensor) -> torch.Tensor:
        """The metadata's output multiplier and soft-capping, applied to raw head outputs."""
        m = self.metadata
        if m.output_multiplier != 1.0:
            out = out * m.output_multiplier
        if m.final_logit_softcapping:
            out = torch.tanh(out / m.final_logit_softcapping) * m.final_logit_softcapping
        return out


def build_draft(
    target_config,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    intermediate_size: int | None = None,
    loss_decay: float | None = None,
    num_heads: int | None = None,
    draft_vocab_size: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
) -> DFlashDraft:
    """A fresh, randomly initialised draft shaped for a target (dims copied from its config).

    target_layer_ids follow z-lab's formula unless given; the caller decides the mask token. A target
    without attention heads (a pure SSM) gets `num_heads` (default hidden // 64, at least 1).
    """
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    from dflash_robot.drafts.metadata import build_target_layer_ids, default_loss_decay

    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = num_heads or getattr(tc, "num_attention_heads", None) or max(1, tc.hidden_size // 64)
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    config = Qwen3Config(
        hidden_size=tc.hidden_size,
        intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=(getattr(tc, "num_key_value_heads", None) or heads) if not num_heads else heads,
        head_dim=(getattr(tc, "head_dim", None) or tc.hidden_size // heads) if not num_heads
        else tc.hidden_size // heads,
        vocab_size=tc.vocab_size,
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rope_parameters={"rope_type": "default", "rope_theta": float(theta)},
        hidden_act="silu",
        attention_bias=False,
        tie_word_embeddings=False,
    )
    meta = DraftMetadata(
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(int(i) for i in target_layer_ids) if target_layer_ids is not None
        else tuple(build_target_layer_ids(tc.num_hidden_layers, num_layers)),
        num_target_layers=tc.num_hidden_layers,
        num_draft_layers=num_layers,
        training_block_size=block_size,
        loss_decay=loss_decay if loss_decay is not None else default_loss_decay(block_size),
        draft_vocab_size=draft_vocab_size,
    )
    draft = DFlashDraft(config, meta)
    if draft_vocab_size is not None:  # until set_vocab: the lowest ids
        draft.set_vocab(torch.arange(draft_vocab_size))
    std = getattr(tc, "initializer_range", 0.02)
    for m in draft.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=std)
    return draft
