"""N-gram lookup branches (prompt lookup decoding) beside the draft's proposal.

The shipped SmolLM2 draft hardly copies: on HumanEval 74% of its misses at block 16 are tokens
of the prompt, many of them inside a docstring or an identifier that the target writes out again
verbatim (docs/TRAINING.md, "Session 47"). Copying is what an n-gram lookup over the request's
own tokens does well: take the last n committed tokens, find their most recent earlier
occurrence in the prompt or the output, and propose the tokens that followed it.

The lookup's proposal is added to the verification tree as one more branch
(`tree.attach_chain`), beside the draft's chain or tree, and verified in the same single target
forward. Acceptance walks the target's own choices down the tree (`tree.tree_accept`), so the
output is the target's whatever the branch proposes: greedy output equals autoregressive
greedy output, and sampling follows the target's distribution exactly. The lookup runs on the
host over a token history the orchestrator already holds (its one transfer per iteration
brings the committed tokens back), in a few vectorised tensor operations: no per-token Python
work and no extra host-device sync.
"""

from __future__ import annotations

import torch

from dflash_robot.errors import ConfigError


class NgramLookup:
    """Proposals from the most recent earlier occurrence of the history's last n tokens, for n
    from `max_ngram` down to `min_ngram` (the longest match wins)."""

    def __init__(self, max_ngram: int, min_ngram: int):
        if not isinstance(max_ngram, int) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"n-gram lookup sizes must be integers with 1 <= min <= max, got "
                              f"min {min_ngram!r}, max {max_ngram!r}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, history: torch.Tensor, k: int) -> torch.Tensor:
        """history [L] (CPU, int64: the prompt and every committed token, the last one included)
        -> up to k tokens that followed the last match (empty: no match)."""
        n_hist = int(history.shape[0])
        if k < 1:
            return history[:0]
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            # windows starting at 0 .. L-1-n: each has at least one token after it, and the
            # history's own suffix (starting at L-n) is not among them
            windows = history[:n_hist - 1].unfold(0, n, 1)
            hits = (windows == history[n_hist - n:]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return history[start:start + k]
        return history[:0]


class TokenHistory:
    """The request's tokens on the host, in one preallocated buffer (appended once per step)."""

    def __init__(self, prompt: torch.Tensor, capacity: int):
        self.buf = torch.empty(prompt.numel() + capacity, dtype=torch.long)
        self.buf[:prompt.numel()] = prompt.cpu()
        self.length = prompt.numel()

    def extend(self, tokens: list[int]) -> None:
        self.buf[self.length:self.length + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        self.length += len(tokens)

    def view(self) -> torch.Tensor:
        return self.buf[:self.length]
