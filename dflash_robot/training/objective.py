"""The DFlash training objective (arXiv 2602.06036, Sec. 3.4). Pure tensor functions.

For one sequence of S tokens with target features F [S, n*H]:
- anchors: random positions a whose next token is a response token (loss_mask[a+1]);
- block j is `[x_{a_j}, mask, ..., mask]` (q tokens) at positions a_j .. a_j+q-1;
- block j sees the context features of positions strictly before a_j, and itself
  bidirectionally; it never sees another block;
- token i >= 1 of block j predicts x_{a_j+i}, with weight exp(-(i-1)/gamma), zero past
  the sequence end or on non-response tokens (optionally scaled up where the label copies the
  context: `copy_positions`, our addition, not the paper's).
With a `hints` lookup (our addition, `DraftMetadata.hint_ngram`) the mask tokens of block j start
with what an n-gram lookup of x_0 .. x_{a_j} proposes (`runtime/lookup.py`), exactly as decoding
fills them: the draft learns to keep a hint the context supports and to replace one it does not.
All blocks of a sequence are trained in parallel in one forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dflash_robot.runtime.lookup import NgramLookup


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """-> [q] weights; index 0 (the clean anchor) is 0, index i >= 1 is exp(-(i-1)/gamma)."""
    w = torch.exp(-(torch.arange(block_size, dtype=torch.float32) - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(loss_mask: torch.Tensor, num_blocks: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """loss_mask [S] bool (True on response tokens) -> sorted anchors [N], N <= num_blocks.

    Candidates are positions a with loss_mask[a + 1]; drawn without replacement.
    """
    assert loss_mask.dim() == 1
    cand = torch.nonzero(loss_mask[1:], as_tuple=True)[0]  # a such that a+1 is a response token
    if cand.numel() == 0:
        return cand
    n = min(num_blocks, cand.numel())
    pick = torch.randperm(cand.numel(), generator=generator)[:n].to(cand.device)  # generator: a CPU one
    return cand[pick].sort().values


def successor_anchors(anchors: torch.Tensor, runs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Where decoding would start its next block: anchor a whose draft matched the next `run`
    tokens is followed by a block at a + run + 1 (the target's own token there). -> the sorted,
    distinct successors that are themselves anchor candidates (their next token is a response
    token). Decoding only ever starts blocks at such positions, right after a miss, and they are
    harder than positions drawn uniformly (docs/TRAINING.md, session 10)."""
    s = anchors + runs + 1
    s = s[s < loss_mask.shape[0] - 1]
    return torch.unique(s[loss_mask[s + 1]])


def copy_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [S] -> bool [S]: True at p where the bigram (x_{p-1}, x_p) already occurred earlier
    in the sequence, ending at some j < p. These are the tokens an n-gram lookup of the context would
    propose: where the shipped draft misses most (docs/TRAINING.md, "Session 47"). Position 0 is
    never one."""
    s = input_ids.shape[0]
    out = torch.zeros(s, dtype=torch.bool, device=input_ids.device)
    if s < 3:
        return out
    pairs = torch.stack([input_ids[:-1], input_ids[1:]], dim=1)  # row p - 1 is the bigram ending at p
    _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    ends = torch.arange(1, s, device=input_ids.device)
    first = torch.full((int(inverse.max()) + 1,), s, dtype=torch.long, device=input_ids.device)
    first = first.scatter_reduce(0, inverse, ends, reduce="amin")
    out[1:] = first[inverse] < ends
    return out


def block_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors [N] -> bool mask [N*q, S + N*q], True = query may attend to key.

    Keys are the S context features followed by the N blocks' own tokens.
    """
    n, q = anchors.shape[0], block_size
    dev = anchors.device
    blk_of_query = torch.arange(n * q, device=dev) // q  # [N*q]
    ctx_visible = torch.arange(seq_len, device=dev)[None, :] < anchors[blk_of_query][:, None]  # [N*q, S]
    same_block = blk_of_query[:, None] == blk_of_query[None, :]  # [N*q, N*q]
    return torch.cat([ctx_visible, same_block], dim=1)


def hint_blocks(block_ids: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                hints: NgramLookup) -> torch.Tensor:
    """block_ids [N*q] (`[x_a, mask...]` per anchor) -> the same with each block's positions 1.. filled
    by `hints.propose(x_0 .. x_a, q - 1)`: what the runtime puts there when it decodes from anchor a
    (the prompt and every committed token, the last one included; nothing after it). A block without
    a match keeps its masks."""
    out = block_ids.clone()
    q = block_size
    cpu = input_ids.cpu()
    for j, a in enumerate(anchors.tolist()):
        found = hints.propose(cpu[:a + 1], q - 1)
        if found.numel():
            out[j * q + 1:j * q + 1 + found.numel()] = found.to(out.device)
    return out


def block_inputs(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int, mask_token_id: int, gamma: float, copy_weight: float = 1.0,
                 hints: NgramLookup | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> block_ids [N*q], positions [N*q], labels [N*q], weights [N*q]. With `copy_weight` != 1 a
    label that continues a bigram of its context (`copy_positions`) has its weight multiplied by it;
    with `hints` the masks start with the lookup's proposal (`hint_blocks`)."""
    q, s = block_size, input_ids.shape[0]
    offs = torch.arange(q, device=input_ids.device)
    pos = (anchors[:, None] + offs[None, :]).reshape(-1)  # [N*q]
    inside = pos < s
    safe = pos.clamp(max=s - 1)
    labels = torch.where(inside, input_ids[safe], torch.zeros_like(safe))
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[offs.repeat(anchors.shape[0]) == 0] = input_ids[anchors]
    if hints is not None:
        block_ids = hint_blocks(block_ids, input_ids, anchors, q, hints)
    w = loss_weights(q, gamma).to(input_ids.device).repeat(anchors.shape[0])
    weights = w * inside * loss_mask[safe]
    if copy_weight != 1.0:
        weights = weights * torch.where(copy_positions(input_ids)[safe], copy_weight, 1.0)
    return block_ids, pos, labels, weights


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [M, V], labels [M], weights [M] -> (sum of weighted CE, sum of weights)."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    return (ce * weights).sum(), weights.sum()


def distill_cross_entropy(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                          weights: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hard and soft labels mixed: per row `(1 - alpha) * CE(label) + alpha * H(p, q)`, with p the
    teacher's softmax over the same columns as the draft's q (so over a draft vocabulary it is
    renormalised there). H(p, q) = KL(p || q) + H(p): its gradient is the forward KL's.
    -> (sum of weighted losses, sum of weights)."""
    logq = F.log_softmax(logits.float(), dim=-1)
    soft = -(F.softmax(teacher_logits.float(), dim=-1) * logq).sum(-1)
    hard = F.nll_loss(logq, labels, reduction="none")
    return (((1 - alpha) * hard + alpha * soft) * weights).sum(), weights.sum()


def expected_acceptance(correct: torch.Tensor) -> torch.Tensor:
    """correct [N, q-1] bool (draft top-1 == label per block position) -> mean over blocks of
    (leading run of correct + 1): the acceptance length greedy chain verification would give
    if the target agreed with its own training labels."""
    run = correct.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return run.float().mean() + 1 if run.numel() else torch.tensor(math.nan)
