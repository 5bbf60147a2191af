"""Acceptance: which drafted tokens the target keeps. Pure tensor functions.

Terms, for one verified block `[x0, d_1, ..., d_{q-1}]` (x0: the last committed token,
d_i: drafted tokens). The target's verify pass gives, at block position i, the
distribution p_i of the token that follows block[i]; the draft gave q_i for d_i.

- accepted: the longest prefix d_1..d_a that the target keeps. Greedy: d_{i+1} is kept
  while it equals argmax p_i. Sampling: d_{i+1} is kept with probability
  min(1, p_i(d_{i+1}) / q_{i+1}(d_{i+1})) (Leviathan et al. 2023, Chen et al. 2023).
- bonus: the target's own token at position a. Greedy: argmax p_a. Sampling: a draw
  from the residual at the first rejection, or from p_{q-1} when all were accepted.
- residual: norm(max(0, p_a - q_{a+1})), the part of p_a the draft under-proposed.
  With it the committed tokens follow the target's distribution exactly.

Each step commits a + 1 tokens: d_1..d_a and the bonus. The result keeps everything on
the device; the orchestrator reads it back in a single transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_robot.runtime.sampling import sample_from


@dataclass
class Acceptance:
    num_accepted: torch.Tensor  # [] int64, a in [0, q-1]
    tokens: torch.Tensor  # [q] int64: tokens[:a] are d_1..d_a, tokens[a] is the bonus


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """draft_tokens [q-1], target_logits [q, V] -> Acceptance (greedy verification)."""
    assert draft_tokens.dim() == 1 and target_logits.dim() == 2
    assert target_logits.shape[0] == draft_tokens.shape[0] + 1
    posterior = target_logits.argmax(dim=-1)  # [q]
    matches = (draft_tokens == posterior[:-1]).to(torch.int64).cumprod(dim=0)  # [q-1]
    # accepted drafts equal the posterior, so the posterior itself is the token row
    return Acceptance(num_accepted=matches.sum(), tokens=posterior)


def rejection_accept(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Acceptance:
    """Speculative rejection sampling over a chain.

    draft_tokens [q-1] int64 (d_i ~ q_i), draft_probs [q-1, V] (q_1..q_{q-1}),
    target_probs [q, V] (p_0..p_{q-1}) -> Acceptance.
    """
    n = draft_tokens.shape[0]
    assert draft_tokens.dim() == 1 and draft_probs.shape[0] == n
    assert target_probs.dim() == 2 and target_probs.shape[0] == n + 1
    assert draft_probs.shape[-1] == target_probs.shape[-1] or n == 0
    idx = draft_tokens[:, None]
    p = target_probs[:n].gather(-1, idx)[:, 0]  # [q-1]
    q = draft_probs.gather(-1, idx)[:, 0]  # [q-1]
    u = torch.rand(n, generator=generator, device=target_probs.device)
    kept = (u * q < p).to(torch.int64).cumprod(dim=0)  # u < p/q without dividing by q
    a = kept.sum()  # [] int64
    # q padded with a zero row: at a == q-1 the "residual" is p_{q-1} itself.
    q_pad = torch.cat([draft_probs.float(), draft_probs.new_zeros(1, target_probs.shape[-1]).float()])
    p_a = target_probs.index_select(0, a.view(1))[0]  # [V]
    residual = (p_a - q_pad.index_select(0, a.view(1))[0]).clamp_min(0)  # [V]
    total = residual.sum()
    # p == q exactly gives a zero residual; rejection then has probability 0, fall back to p_a
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny), p_a)
    bonus = sample_from(residual, generator)  # []
    tokens = torch.cat([draft_tokens, bonus.view(1)])  # [q]
    tokens = tokens.index_put((a.view(1),), bonus.view(1))
    return Acceptance(num_accepted=a, tokens=tokens)
