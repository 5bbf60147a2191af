"""Target adapters: the one interface the runtime uses to drive a target model.

A target adapter owns the target's cache. The orchestrator only ever calls:
prefill -> (snapshot -> verify -> rollback)*, and never reaches into cache internals.
Attention-only, sliding-window and (later) recurrent targets differ only in here.

Features follow z-lab's meaning: for tapped ids `[i_1, ..., i_n]` the feature of a token
is `concat(hidden_states[i_1 + 1], ..., hidden_states[i_n + 1])`, where hidden_states[0]
is the embedding output and hidden_states[L] comes after the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from .errors import UnsupportedModelError


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [q, V] (prefill: [1, V], the last prompt position only)
    features: torch.Tensor | None  # [q, n_ids * H] (prefill: [P, n_ids * H]); None if not tapped


@dataclass
class CacheSnapshot:
    """What a rollback needs. Attention caches need only the length; recurrent targets
    add their conv/recurrent states in `states`."""

    seq_len: int
    states: object | None = None


@runtime_checkable
class TargetAdapter(Protocol):
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype
    device: torch.device

    @property
    def seq_len(self) -> int: ...  # tokens in the target cache

    def reset(self) -> None: ...

    def prefill(self, input_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                chunk_size: int) -> TargetOutput: ...

    def verify(self, block_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
               sequential: bool = False) -> TargetOutput: ...

    def snapshot(self) -> CacheSnapshot: ...

    def rollback(self, snapshot: CacheSnapshot, num_kept: int) -> None: ...

    def crop(self, length: int) -> None: ...

    def input_embedding_weight(self) -> torch.Tensor: ...  # [V, H], raw (unscaled)

    def output_head(self) -> nn.Module: ...


def _has_state_layers(model: PreTrainedModel) -> bool:
    """Stateful by capability: the flag, or linear-attention/SSM layers in its cache."""
    from .stateful import is_stateful

    return is_stateful(model)


ENGINES = ("auto", "hf", "lean")


def make_target_adapter(model: PreTrainedModel, rollback: str | None = None, engine: str = "hf") -> TargetAdapter:
    """The adapter for `model`, chosen by what its cache holds: attention-only targets get
    `HFTargetAdapter` (or, with `engine="lean"`/`"auto"`, the lean engine of `lean.py` where it
    supports the architecture), targets with linear-attention/SSM states `StatefulTargetAdapter`
    with the `rollback` strategy ("replay" or "capture"; None = the measured default).
    Attention-only targets roll back by cropping, whatever `rollback` says.
    `engine="lean"` refuses a model the lean engine cannot run; `"auto"` falls back to HF."""
    from .errors import ConfigError
    from .stateful import ROLLBACKS, StatefulTargetAdapter

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {ENGINES}, got {engine!r}")
    if _has_state_layers(model):
        if engine == "lean":
            raise UnsupportedModelError(f"the lean engine does not run stateful (hybrid) targets like "
                                        f"{type(model).__name__}; use engine='hf' or 'auto'")
        return StatefulTargetAdapter(model, rollback)
    if rollback is not None and rollback not in ROLLBACKS:
        raise ConfigError(f"rollback must be one of {ROLLBACKS}, got {rollback!r}")
    if engine != "hf":
        from .lean import LeanTargetAdapter, supports

        if engine == "lean" or supports(model):
            return LeanTargetAdapter(model)  # type: ignore[return-value]
    return HFTargetAdapter(model)


class ChunkedForwardAdapter:
    """`prefill` and `verify` for adapters built on one primitive, `_forward(ids, taps,
    logits_to_keep)` -> TargetOutput, which appends `ids` to the cache. `_trim()` runs after
    every prefill chunk (a no-op unless the cache needs it)."""

    def reset(self) -> None:
        raise NotImplementedError

    def _forward(self, ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                 logits_to_keep: int = 0) -> TargetOutput:
        raise NotImplementedError

    def _trim(self) -> None:
        return None

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                chunk_size: int = 512) -> TargetOutput:
        """input_ids [P] -> logits [1, V] at the last position, features [P, n*H]."""
        self.reset()
        feats: list[torch.Tensor] = []
        out = None
        for start in range(0, input_ids.shape[0], chunk_size):
            out = self._forward(input_ids[start:start + chunk_size], tap_layer_ids, logits_to_keep=1)
            self._trim()
            if out.features is not None:
                feats.append(out.features)
        assert out is not None, "prefill needs at least one token"
        return TargetOutput(out.logits, torch.cat(feats) if feats else None)

    @torch.inference_mode()
    def verify(self, block_ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
               sequential: bool = False) -> TargetOutput:
        """block_ids [q] -> logits [q, V], features [q, n*H]. Leaves all q in the cache.

        sequential=True feeds the block one token at a time: slower, but the reference
        for hunting batched-vs-sequential numeric mismatches.
        """
        if not sequential:
            return self._forward(block_ids, tap_layer_ids)
        outs = [self._forward(block_ids[i:i + 1], tap_layer_ids) for i in range(block_ids.shape[0])]
        feats = None if tap_layer_ids is None else torch.cat([o.features for o in outs])  # type: ignore[misc]
        return TargetOutput(torch.cat([o.logits for o in outs]), feats)


class HFTargetAdapter(ChunkedForwardAdapter):
    """Any transformers causal LM with an attention-only (full or sliding-window) cache.

    The cache is a `DynamicCache` with past recording active, so sliding-window layers
    keep rejected tokens until the rollback's crop, which then restores the window.
    """

    def __init__(self, model: PreTrainedModel):
        if type(self) is HFTargetAdapter and _has_state_layers(model):
            raise UnsupportedModelError(
                f"{type(model).__name__} is stateful (linear-attention/SSM layers); "
                "HFTargetAdapter supports attention-only targets: use make_target_adapter() "
                "or StatefulTargetAdapter")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model = model.eval()
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        emb: torch.Tensor = model.get_input_embeddings().weight  # type: ignore[assignment]
        self.vocab_size = int(emb.shape[0])
        self.dtype: torch.dtype = emb.dtype
        self.device: torch.device = emb.device
        self.max_length: int | None = getattr(cfg, "max_position_embeddings", None)
        self._cache: DynamicCache | None = None
        self._len = 0

    @property
    def seq_len(self) -> int:
        return self._len

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        self._cache.activate_past_recording()
        for layer in self._cache.layers:
            if not getattr(layer, "is_croppable", False) and not hasattr(layer, "record_past"):
                raise UnsupportedModelError(
                    f"cache layer {type(layer).__name__} cannot be rolled back")
        self._len = 0

    def _forward(self, ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                 logits_to_keep: int = 0) -> TargetOutput:
        """ids [T] -> logits [T or logits_to_keep, V], features [T, n*H]."""
        assert self._cache is not None, "call reset() before running the target"
        t = ids.shape[0]
        positions = torch.arange(self._len, self._len + t, device=self.device)[None]
        hs_idx = [i + 1 for i in tap_layer_ids] if tap_layer_ids else False
        out = self.model(input_ids=ids[None], position_ids=positions, cache=self._cache,
                         use_cache=True, output_hidden_states=hs_idx, logits_to_keep=logits_to_keep)
        self._len += t
        feats = None
        if tap_layer_ids:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in tap_layer_ids], dim=-1)
        return TargetOutput(logits=out.logits[0], features=feats)

    def _trim(self) -> None:
        """After a prefill chunk: sliding layers drop what left the window."""
        self._cache.crop(0)  # type: ignore[union-attr]

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(seq_len=self._len)

    def rollback(self, snapshot: CacheSnapshot, num_kept: int) -> None:
        """Keep the first `num_kept` tokens verified since `snapshot`."""
        self.crop(snapshot.seq_len + num_kept)

    def crop(self, length: int) -> None:
        assert self._cache is not None and 0 <= length <= self._len
        self._cache.crop(-(self._len - length))  # transformers 5.x: a negative count removes
        self._len = length

    def input_embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # type: ignore[return-value]

    def output_head(self) -> nn.Module:
        head = self.model.get_output_embeddings()
        if head is None:
            raise UnsupportedModelError(f"{type(self.model).__name__} has no output head")
        return head
