"""Target adapters: the one interface the runtime uses to drive a target model.

A target adapter owns the target's cache. The orchestrator only ever calls:
prefill -> (snapshot -> verify -> rollback | snapshot -> verify_tree -> compact)*, and never
reaches into cache internals.
Attention-only, sliding-window and recurrent targets differ only in their adapters:
`hf.py`, `lean.py`, `stateful.py`; `factory.py` picks one by capability.

Features follow z-lab's meaning: for tapped ids `[i_1, ..., i_n]` the feature of a token
is `concat(hidden_states[i_1 + 1], ..., hidden_states[i_n + 1])`, where hidden_states[0]
is the embedding output and hidden_states[L] comes after the final norm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

ROLLBACKS = ("replay", "capture")  # how a stateful (hybrid) target rolls back: targets/stateful.py


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

    # tree verification (runtime/tree.py); `tree_unsupported` is None, or why not
    tree_unsupported: str | None

    def verify_tree(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                    tap_layer_ids: tuple[int, ...] | None) -> TargetOutput: ...

    def compact(self, snapshot: CacheSnapshot, kept_nodes: list[int]) -> None: ...

    def crop(self, length: int) -> None: ...

    def input_embedding_weight(self) -> torch.Tensor: ...  # [V, H], raw (unscaled)

    def output_head(self) -> nn.Module: ...


class PositionCache:
    """Snapshot / rollback / crop for caches whose entries past `_len` are simply never read
    again before being overwritten (preallocated buffers indexed by position): a rollback is a
    new length, nothing is copied or freed."""

    _len: int

    @property
    def seq_len(self) -> int:
        return self._len

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(seq_len=self._len)

    def rollback(self, snapshot: CacheSnapshot, num_kept: int) -> None:
        self.crop(snapshot.seq_len + num_kept)

    def crop(self, length: int) -> None:
        assert 0 <= length <= self._len
        self._len = length


class ChunkedForwardAdapter:
    """`prefill` and `verify` for adapters built on one primitive, `_forward(ids, taps,
    logits_to_keep)` -> TargetOutput, which appends `ids` to the cache. `_trim()` runs after
    every prefill chunk (a no-op unless the cache needs it)."""

    tree_unsupported: str | None = None

    @property
    def seq_len(self) -> int:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def rollback(self, snapshot: CacheSnapshot, num_kept: int) -> None:
        raise NotImplementedError

    def _forward(self, ids: torch.Tensor, tap_layer_ids: tuple[int, ...] | None,
                 logits_to_keep: int = 0, positions: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None) -> TargetOutput:
        """`positions` [T] (default: the next T) are the tokens' position ids; `tree_mask`
        [T, T] bool, when given, replaces causal attention among the T new tokens (each
        still sees the whole committed cache)."""
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

    @torch.inference_mode()
    def verify_tree(self, tokens: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor,
                    tap_layer_ids: tuple[int, ...] | None) -> TargetOutput:
        """Verify a draft tree in one forward: tokens [M] (node 0 = the last committed token),
        depths [M], ancestors [M, M] (node j attends to node i iff ancestors[j, i]).
        -> logits [M, V], features [M, n*H]. The M nodes occupy the next M cache slots, node
        order, until `compact` keeps the accepted path."""
        if self.tree_unsupported is not None:
            from dflash_robot.errors import UnsupportedModelError

            raise UnsupportedModelError(f"tree verification: {self.tree_unsupported}")
        return self._forward(tokens, tap_layer_ids, positions=depths + self.seq_len, tree_mask=ancestors)

    @torch.inference_mode()
    def compact(self, snapshot: CacheSnapshot, kept_nodes: list[int]) -> None:
        """After `verify_tree`: keep the cache entries of `kept_nodes` (node indices, root first,
        increasing) as the committed continuation of `snapshot`; drop the other nodes."""
        n = len(kept_nodes)
        if kept_nodes != list(range(n)):
            self._move_slots(snapshot.seq_len, kept_nodes)
        self.rollback(snapshot, n)

    def _move_slots(self, base: int, kept_nodes: list[int]) -> None:
        """Cache slots base + kept_nodes[i] -> base + i (each cache implements it)."""
        raise NotImplementedError
