"""Chain proposal: the draft side of one DFlash iteration (paper Sec. 3.1, steps 8-10).

`DraftAdapter` is what the orchestrator needs from any drafter. `DFlashProposer` binds a
`DFlashDraft` to its target's embedding table and lm_head and owns the draft's context
cache for the current sequence.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from dflash_robot.drafts.metadata import DraftMetadata
from dflash_robot.drafts.model import DFlashDraft, DraftKVCache


@runtime_checkable
class DraftAdapter(Protocol):
    metadata: DraftMetadata
    vocab_ids: torch.Tensor | None  # [N] target ids of the draft's logits columns; None = all V

    def reset(self) -> None: ...

    def propose(self, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor: ...


class DFlashProposer:
    """Draft logits for a block `[last, mask, ..., mask]`, in one non-causal forward."""

    def __init__(self, draft: DFlashDraft, embedding_weight: torch.Tensor, head: nn.Module):
        self.draft = draft.eval()
        self.metadata = draft.metadata
        self.embedding_weight = embedding_weight  # [V, H] raw target embedding
        self.vocab_ids = draft.vocab_ids
        if self.vocab_ids is not None:  # the head's rows for the draft vocabulary, gathered once
            from dflash_robot.targets.fastpath import linear_fn

            w, b = draft.head_weight(head)
            self._sub_head = linear_fn(w.detach().contiguous(), None if b is None else b.detach())
        self.head = head
        self._cache: DraftKVCache | None = None

    def reset(self) -> None:
        if self._cache is None:
            self._cache = self.draft.new_cache()
        self._cache.length = 0

    @property
    def context_length(self) -> int:
        return 0 if self._cache is None else self._cache.length

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """features [c, n*H]: target features of the tokens committed since the last call;
        block_ids [q]: `[last, mask, ...]`, last at position (context length + c).
        -> draft logits [q-1, V] for block positions 1..q-1 ([q-1, N] over `vocab_ids` when the
        draft has its own vocabulary).
        """
        assert self._cache is not None, "call reset() first"
        c, q = features.shape[0], block_ids.shape[0]
        start = self._cache.length
        device = block_ids.device
        ctx_pos = torch.arange(start, start + c, device=device)[None]
        blk_pos = torch.arange(start + c, start + c + q, device=device)[None]
        noise = F.embedding(block_ids, self.embedding_weight)[None]
        if self.metadata.input_embedding_scale != 1.0:
            noise = noise * self.metadata.input_embedding_scale
        hidden = self.draft(noise, features[None], blk_pos, ctx_pos, cache=self._cache)
        if self.vocab_ids is not None:
            return self.draft.finish_logits(self._sub_head(hidden[0, 1:]))
        return self.draft.logits(hidden[0, 1:], self.head)
