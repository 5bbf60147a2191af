"""Chain proposal: the draft side of one DFlash iteration (paper Sec. 3.1, steps 8-10).

`DraftAdapter` is what the orchestrator needs from any drafter. `DFlashProposer` binds a
`DFlashDraft` to its target's embedding table and lm_head and owns the draft's context
cache for the current sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
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

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        """Start a new sequence. `prompt` [P]: its token ids; a `prompt_vocab` draft appends those
        outside its vocabulary to its head (and `vocab_ids`) until the next reset."""
        ...

    def propose(self, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor: ...


class FeatureMirror:
    """Target features -> the draft's device and dtype (Luce's `DraftFeatureMirror`).

    Called once per step on the features of the newly committed positions only (the draft
    keeps everything older in its own KV cache), as one non-blocking copy: no host sync."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.copies = 0  # steps whose features crossed (tests read it)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.device == self.device and x.dtype == self.dtype:
            return x
        self.copies += 1
        return x.to(device=self.device, dtype=self.dtype, non_blocking=True)


def _lean_supported(draft: DFlashDraft) -> bool:
    from dflash_robot.drafts.lean import LeanDraftForward

    return LeanDraftForward.unsupported_reason(draft) is None


class DFlashProposer:
    """Draft logits for a block `[last, mask, ..., mask]`, in one non-causal forward.

    The draft may live on another device or in another dtype than its target: the target's
    embedding table and head are then copied to the draft's side once, and each step's new
    features go through a `FeatureMirror`. Logits stay on the draft's side; the orchestrator
    brings the q - 1 drafted ids (and, when sampling, their probabilities) back."""

    def __init__(self, draft: DFlashDraft, embedding_weight: torch.Tensor, head: nn.Module, lean: bool = True,
                 precision: str = "fp32"):
        """`lean` runs the draft through `LeanDraftForward` (`drafts/lean.py`: the same function in
        fewer operations); False runs the module itself (`DFlashDraft.forward`). `precision`: the
        lean forward's weights (`targets/quant.py`; the head's draft-vocabulary rows are bf16 below fp32).
        The lean forward and the head keep copies of the weights made here: build the proposer
        after training the draft, not before."""
        self.draft = draft.eval()
        self.metadata = draft.metadata
        p = draft.fc.weight
        self.mirror = FeatureMirror(p.device, p.dtype)
        same = embedding_weight.device == p.device and embedding_weight.dtype == p.dtype
        self.embedding_weight = embedding_weight if same else embedding_weight.detach().to(p.device, p.dtype)
        self.vocab_ids = self._base_ids = draft.vocab_ids
        self._extra_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # this request's prompt columns
        head_w: torch.Tensor = head.weight  # type: ignore[assignment]
        self._sub_head = None
        # the head's rows (for the draft vocabulary, or all), on the draft's side, gathered once
        self._head_fn: Callable[[torch.Tensor, torch.Tensor | None], Callable[[torch.Tensor], torch.Tensor]]
        if lean and precision != "fp32" and p.dtype == torch.float32 and p.device.type == "cpu" and \
                _lean_supported(draft):
            from dflash_robot.targets.quant import make_linear

            self._head_fn = functools.partial(make_linear, precision="bf16")  # as the target's head: bf16 below fp32
        else:
            from dflash_robot.targets.fastpath import linear_fn

            self._head_fn = linear_fn
        if self.vocab_ids is not None or head_w.device != p.device or head_w.dtype != p.dtype:
            w, b = draft.head_weight(head)
            self._sub_head = self._head_fn(*self._draft_side(w, b))
        self.head = head
        self._cache: DraftKVCache | None = None
        self._lean = None
        if lean:
            from dflash_robot.drafts.lean import LeanDraftForward

            if LeanDraftForward.unsupported_reason(draft) is None:  # else the module runs (same function)
                self._lean = LeanDraftForward(draft, precision)

    def reset(self, prompt: torch.Tensor | None = None) -> None:
        self._set_prompt(prompt)
        if self._lean is not None:
            self._lean.reset()
            return
        if self._cache is None:
            self._cache = self.draft.new_cache()
        self._cache.length = 0

    def _set_prompt(self, prompt: torch.Tensor | None) -> None:
        """The request's extra head columns (`DFlashDraft.prompt_extra`): once per request, E rows of
        the target's head gathered to the draft's side; none without a prompt or `prompt_vocab`."""
        self.vocab_ids, self._extra_head = self._base_ids, None
        extra = None if prompt is None else self.draft.prompt_extra(prompt)
        if extra is None or extra.numel() == 0:
            return
        assert self._base_ids is not None  # prompt_vocab needs a draft vocabulary (DraftMetadata)
        head_w: torch.Tensor = self.head.weight  # type: ignore[assignment]
        b: torch.Tensor | None = getattr(self.head, "bias", None)
        rows = extra.to(head_w.device)
        self._extra_head = self._head_fn(*self._draft_side(head_w[rows], None if b is None else b[rows]))
        self.vocab_ids = torch.cat([self._base_ids, extra.to(self._base_ids.device)])

    def _draft_side(self, w: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        p = self.draft.fc.weight
        return w.detach().to(p.device, p.dtype).contiguous(), None if b is None else b.detach().to(p.device, p.dtype)

    @property
    def context_length(self) -> int:
        if self._lean is not None:
            return self._lean.length
        return 0 if self._cache is None else self._cache.length

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """features [c, n*H]: target features of the tokens committed since the last call;
        block_ids [q]: `[last, mask, ...]`, last at position (context length + c).
        -> draft logits [q-1, V] for block positions 1..q-1 ([q-1, N] over `vocab_ids` when the
        draft has its own vocabulary).
        """
        features = self.mirror(features)  # the newly committed positions only
        block_ids = block_ids.to(self.mirror.device, non_blocking=True)
        noise = F.embedding(block_ids, self.embedding_weight)
        if self.metadata.input_embedding_scale != 1.0:
            noise = noise * self.metadata.input_embedding_scale
        if self._lean is not None:
            rows = self._lean.forward(noise, features)[1:]
        else:
            assert self._cache is not None, "call reset() first"
            c, q = features.shape[0], block_ids.shape[0]
            start = self._cache.length
            device = block_ids.device
            ctx_pos = torch.arange(start, start + c, device=device)[None]
            blk_pos = torch.arange(start + c, start + c + q, device=device)[None]
            rows = self.draft(noise[None], features[None], blk_pos, ctx_pos, cache=self._cache)[0, 1:]
        if self._sub_head is not None:
            out = self._sub_head(rows)
            if self._extra_head is not None:  # the request's prompt columns, after the vocabulary's
                out = torch.cat([out, self._extra_head(rows).to(out.dtype)], dim=-1)
            return self.draft.finish_logits(out)
        assert self._extra_head is None  # prompt columns exist only with a draft vocabulary (a sub head)
        return self.draft.logits(rows, self.head)
