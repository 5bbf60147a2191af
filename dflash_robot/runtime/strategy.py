"""Proposal strategies: what one iteration drafts, verifies and keeps.

`RuntimeOrchestrator` runs the same loop for both; a strategy supplies the four steps that
differ:

- `ChainStrategy` (paper Sec. 3.1): block `[last, d_1..d_{q-1}]`, the draft's argmax (or a
  draw) at each position; verified causally; greedy prefix match or rejection sampling;
  the cache keeps the first `produced` block tokens.
- `TreeStrategy` (DDTree): the same single draft forward, then the `budget` best nodes of
  the per-depth top-k (`runtime/tree.py`); verified in one forward with an ancestor-only
  mask; the target's own token is walked down the children; the cache keeps the accepted
  path's entries, moved into place (`TargetAdapter.compact`), without re-running the target.

Either may get a `branch` from an n-gram lookup (`runtime/lookup.py`): it is merged into the
proposal as one more path of a tree (a chain becomes a tree of its argmax tokens first), and the
iteration then verifies, accepts and commits as a tree does.

Both keep everything on the device until the orchestrator's one transfer per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_robot.errors import ConfigError
from dflash_robot.runtime.acceptance import Acceptance, greedy_accept, rejection_accept
from dflash_robot.runtime.config import SamplingConfig
from dflash_robot.runtime.proposer import DraftAdapter
from dflash_robot.runtime.sampling import sample_from, sampling_probs
from dflash_robot.runtime.tree import DraftTree, attach_chain, build_tree, chain_tree, tree_accept
from dflash_robot.targets.base import CacheSnapshot, TargetAdapter, TargetOutput


@dataclass
class Proposal:
    tokens: torch.Tensor  # [M] the tokens verified (chain: the block, M = q)
    draft_probs: torch.Tensor | None = None  # chain sampling: the draft's distribution [q-1, V]
    tree: DraftTree | None = None


class ChainStrategy:
    name = "chain"

    def __init__(self, drafter: DraftAdapter | None, vocab_size: int):
        self.drafter = drafter
        self.vocab_size = vocab_size
        self.mask_id = drafter.metadata.mask_token_id if drafter is not None else 0

    def _draft_logits(self, last: torch.Tensor, features: torch.Tensor | None, q: int,
                      hint: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The one draft forward of an iteration: -> (block [q] = [last, mask...], logits [q-1, V]
        or [q-1, N] over the draft's `vocab_ids`, on the draft's side). A `hint` [h <= q-1] (a
        hinted draft's lookup tokens, `DraftMetadata.hint_ngram`) takes the first h mask positions."""
        assert self.drafter is not None and features is not None
        block = torch.full((q,), self.mask_id, dtype=torch.long, device=last.device)
        block[:1] = last
        if hint is not None and hint.numel():
            block[1:1 + hint.numel()] = hint[:q - 1].to(block.device, non_blocking=True)
        return block, self.drafter.propose(features, block)

    def propose(self, last: torch.Tensor, features: torch.Tensor | None, q: int,
                sampling: SamplingConfig, gen: torch.Generator, branch: torch.Tensor | None = None,
                hint: torch.Tensor | None = None) -> Proposal:
        """-> block [q] = [last, d_1..d_{q-1}], and the draft probs [q-1, V] when sampling. With a
        `branch` [L >= 1] (lookup tokens, on the target's side): a tree of the draft's argmax
        chain and the branch, greedy or sampling alike (tree acceptance draws from the target).
        `hint`: the draft's own block inputs after `last` (`_draft_logits`), drafted over."""
        if q == 1:
            return Proposal(last)
        block, logits = self._draft_logits(last, features, q, hint)
        ids = self.drafter.vocab_ids  # type: ignore[union-attr]  # [N] or None
        if sampling.greedy or branch is not None:
            drafted = logits.argmax(dim=-1)
            block[1:] = drafted if ids is None else ids[drafted]  # q - 1 ids back to the target's side
            if branch is not None:
                return with_branch(Proposal(block, tree=chain_tree(block)), branch)
            return Proposal(block)
        probs = sampling_probs(logits.to(block.device, torch.float32), sampling)
        drafted = sample_from(probs, gen)
        if ids is None:
            block[1:] = drafted
            return Proposal(block, probs)
        ids = ids.to(block.device)
        block[1:] = ids[drafted]  # the draft's distribution on the full vocabulary: zero off vocab_ids
        full = probs.new_zeros(probs.shape[0], self.vocab_size)
        return Proposal(block, full.index_copy_(1, ids, probs))

    def verify(self, target: TargetAdapter, proposal: Proposal, tap: tuple[int, ...] | None,
               sequential: bool) -> TargetOutput:
        tree = proposal.tree
        if tree is None:
            return target.verify(proposal.tokens, tap, sequential=sequential)
        return target.verify_tree(tree.tokens, tree.depths, tree.ancestors, tap)

    def accept(self, proposal: Proposal, logits: torch.Tensor, sampling: SamplingConfig,
               gen: torch.Generator) -> Acceptance:
        tree = proposal.tree
        if tree is not None:
            # the target's token at every node: its argmax, or one draw from its processed distribution
            choice = logits.argmax(dim=-1) if sampling.greedy else sample_from(sampling_probs(logits, sampling), gen)
            return tree_accept(tree, choice)
        block = proposal.tokens
        if sampling.greedy:
            return greedy_accept(block[1:], logits)
        target_probs = sampling_probs(logits, sampling)  # [q, V]
        draft_probs = proposal.draft_probs
        if draft_probs is None:
            draft_probs = target_probs.new_zeros(0, target_probs.shape[-1])
        return rejection_accept(block[1:], draft_probs, target_probs, gen)

    def commit(self, target: TargetAdapter, snap: CacheSnapshot, path: list[int] | None,
               produced: int) -> None:
        if path is None:
            target.rollback(snap, produced)
        else:
            target.compact(snap, path[:produced])


def with_branch(proposal: Proposal, branch: torch.Tensor) -> Proposal:
    """A tree proposal with one more path, `branch` (tokens for depths 1..), merged in. On a CPU
    target the rows it shares with the tree are dropped (a read costs less than a row)."""
    tree = proposal.tree
    assert tree is not None
    tree = attach_chain(tree, branch, drop_dead=tree.tokens.device.type == "cpu")
    return Proposal(tree.tokens, tree=tree)


class TreeStrategy(ChainStrategy):
    """DDTree over the chain's draft forward. `budget` drafted nodes (the verify forward has
    budget + 1 rows), per-depth `topk` candidates (default: the budget, as the heap allows),
    depth up to q - 1. At q == 1 (no draft) it is the chain's autoregressive step."""

    name = "tree"

    def __init__(self, drafter: DraftAdapter | None, vocab_size: int, budget: int, topk: int | None = None):
        super().__init__(drafter, vocab_size)
        if drafter is None:
            raise ConfigError("tree verification needs a draft")
        if not isinstance(budget, int) or budget < 1:
            raise ConfigError(f"tree budget must be an integer >= 1, got {budget!r}")
        if topk is not None and (not isinstance(topk, int) or topk < 1):
            raise ConfigError(f"tree top-k must be an integer >= 1, got {topk!r}")
        self.budget = budget
        self.topk = budget if topk is None else topk

    def propose(self, last: torch.Tensor, features: torch.Tensor | None, q: int,
                sampling: SamplingConfig, gen: torch.Generator, branch: torch.Tensor | None = None,
                hint: torch.Tensor | None = None) -> Proposal:
        if q == 1:
            return Proposal(last)
        _, logits = self._draft_logits(last, features, q, hint)
        logprobs = F.log_softmax(logits.float(), dim=-1)
        ids = self.drafter.vocab_ids  # type: ignore[union-attr]
        tree = build_tree(last.to(logprobs.device), logprobs, self.budget, self.topk,
                          None if ids is None else ids.to(logprobs.device))
        if tree.tokens.device != last.device:
            dev = last.device
            tree = DraftTree(tree.tokens.to(dev), tree.parents.to(dev), tree.depths.to(dev),
                             tree.ancestors.to(dev), tree.max_depth)
        proposal = Proposal(tree.tokens, tree=tree)
        return proposal if branch is None else with_branch(proposal, branch)
