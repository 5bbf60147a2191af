"""`HFTargetAdapter`: any transformers causal LM with an attention-only cache."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache, PreTrainedModel

from dflash_robot.errors import UnsupportedModelError
from dflash_robot.targets.base import CacheSnapshot, ChunkedForwardAdapter, TargetOutput
from dflash_robot.targets.capabilities import is_stateful


class HFTargetAdapter(ChunkedForwardAdapter):
    """Any transformers causal LM with an attention-only (full or sliding-window) cache.

    The cache is a `DynamicCache` with past recording active, so sliding-window layers
    keep rejected tokens until the rollback's crop, which then restores the window.
    """

    def __init__(self, model: PreTrainedModel):
        if type(self) is HFTargetAdapter and is_stateful(model):
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
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("eager", "sdpa"):  # flex adds a boolean mask as 0/1, flash attention ignores 4D masks
            self.tree_unsupported = (f"attention implementation {impl!r} does not take the 4D ancestor mask "
                                     "a tree needs (use attn_implementation='sdpa' or 'eager')")
        elif type(self).tree_unsupported is None:  # (a subclass may refuse trees altogether)
            # a layer layout the per-type masks cannot express: known now, not at the first tree
            problem = self._layer_kinds_problem(self._layer_kinds(DynamicCache(config=model.config)))
            if problem is not None:
                self.tree_unsupported = problem

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
                 logits_to_keep: int = 0, positions: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """ids [T] -> logits [T or logits_to_keep, V], features [T, n*H]."""
        assert self._cache is not None, "call reset() before running the target"
        t = ids.shape[0]
        if positions is None:
            positions = torch.arange(self._len, self._len + t, device=self.device)
        mask = None if tree_mask is None else self._tree_attention_mask(positions, tree_mask)
        hs_idx = [i + 1 for i in tap_layer_ids] if tap_layer_ids else False
        out = self.model(input_ids=ids[None], position_ids=positions[None], cache=self._cache,
                         attention_mask=mask, use_cache=True, output_hidden_states=hs_idx,
                         logits_to_keep=logits_to_keep)
        self._len += t
        feats = None
        if tap_layer_ids:
            hs = out.hidden_states
            feats = torch.cat([hs[i + 1][0] for i in tap_layer_ids], dim=-1)
        return TargetOutput(logits=out.logits[0], features=feats)

    def _tree_attention_mask(self, positions: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor | dict:
        """The 4D mask(s) transformers takes as given: each tree node sees the committed keys
        its layer holds (all of them, or a sliding window's) and its own ancestors. Boolean
        (True = attend) for SDPA, additive for eager attention. The layer kinds come from the
        cache itself (a model may slide every layer without naming `layer_types`)."""
        assert self._cache is not None
        s, t = self._len, positions.shape[0]
        kinds = self._layer_kinds(self._cache)
        masks: dict[int | None, torch.Tensor] = {}
        for w in dict.fromkeys(kinds):
            if w is None:
                m = torch.cat([torch.ones(t, s, dtype=torch.bool, device=self.device), tree_mask], dim=1)
            else:
                held = min(s, int(w) - 1)  # what a sliding layer (past recording on) returns before the new keys
                key_pos = torch.cat([torch.arange(s - held, s, device=self.device), positions])
                m = torch.cat([torch.ones(t, held, dtype=torch.bool, device=self.device), tree_mask], dim=1)
                m &= key_pos[None, :] > positions[:, None] - int(w)
            if self.config._attn_implementation == "eager":
                floor = torch.finfo(self.dtype).min
                m = torch.zeros(m.shape, dtype=self.dtype, device=self.device).masked_fill(~m, floor)
            masks[w] = m[None, None]
        if len(masks) == 1:
            return next(iter(masks.values()))
        # mixed layers: one mask per layer type, the mapping Gemma 3 style models accept
        problem = self._layer_kinds_problem(kinds)
        if problem is not None:
            raise UnsupportedModelError(f"tree verification: {problem}")
        types = list(getattr(self.config, "layer_types", None) or [])
        return {kind: masks[w] for kind, w in zip(types, kinds, strict=True)}

    @staticmethod
    def _layer_kinds(cache: DynamicCache) -> list[int | None]:
        """Each cache layer's attention: None = full, else its sliding window."""
        return [getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
                for layer in cache.layers]

    def _layer_kinds_problem(self, kinds: list[int | None]) -> str | None:
        """Why one 4D mask per layer type cannot serve these layers, or None."""
        if len(set(kinds)) <= 1:
            return None
        types = list(getattr(self.config, "layer_types", None) or [])
        if len(types) != len(kinds):
            return "this model mixes sliding and full layers without naming them in config.layer_types"
        seen: dict[str, int | None] = {}
        for kind, w in zip(types, kinds, strict=True):
            if seen.setdefault(kind, w) != w:
                return f"layers of type {kind!r} differ in their window"
        return None

    def _move_slots(self, base: int, kept_nodes: list[int]) -> None:
        """The tree's nodes are the last (length - base) entries of every layer (sliding
        layers keep them too, past recording being on, until the crop)."""
        m = self._len - base
        keep = torch.tensor(kept_nodes, device=self.device)
        n = len(kept_nodes)
        for layer in self._cache.layers:  # type: ignore[union-attr]
            for name in ("keys", "values"):
                x = getattr(layer, name)
                first = x.shape[-2] - m
                x[:, :, first:first + n] = x[:, :, first + keep]

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
