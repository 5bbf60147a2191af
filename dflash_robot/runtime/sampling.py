"""Turning logits into sampling distributions. Pure tensor functions, no model or cache.

The same processing (temperature, then top-k, then top-p) is applied to the target's
and the draft's logits; the target's processed distribution is the one the output
must follow exactly (see `acceptance.py`).
"""

from __future__ import annotations

import torch

from dflash_robot.runtime.config import SamplingConfig


def sampling_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> fp32 probabilities [..., V] after temperature, top-k and top-p.

    top-k keeps the k largest scores (ties at the k-th value are kept too); top-p then
    keeps the smallest set of most likely tokens whose mass reaches top_p.
    """
    assert cfg.temperature > 0, "sampling_probs is for temperature > 0; greedy uses argmax"
    scores = logits.float() / cfg.temperature
    vocab = scores.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(scores, cfg.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep a token if the mass strictly before it is below top_p (so the crossing token stays)
        keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < cfg.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] -> token ids [...] (int64), one exact draw per row.

    argmax(p / E) with E ~ Exponential(1) i.i.d. is a draw from p (the Gumbel-max trick in
    exponential form). Unlike `torch.multinomial` it never checks its input on the host, so
    it adds no device sync.
    """
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    e.clamp_min_(torch.finfo(torch.float32).tiny)  # a 0 draw would make p/0 inf, or nan where p is 0
    return (probs.float() / e).argmax(dim=-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig,
               generator: torch.Generator | None) -> torch.Tensor:
    """logits [..., V] -> token ids [...]: argmax when greedy, else a draw from `sampling_probs`."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return sample_from(sampling_probs(logits, cfg), generator)
