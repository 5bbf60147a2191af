"""Runtime settings: sampling and per-request generation settings (frozen dataclasses)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash_robot.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """Target sampling settings. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)) \
                or self.temperature < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


MAX_LOOKUP_TOKENS = 64  # a lookup branch's tokens are verify rows (an L x L mask): bounded
DEFAULT_LOOKUP_NGRAM = (3, 4)  # (min, max) n-gram sizes a lookup matches, longest first


@dataclass(frozen=True)
class GenerationConfig:
    """Per-request settings for one generation."""

    max_new_tokens: int = 128
    block_size: int | None = None  # None: the draft's default block size
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    verify_mode: str = "batched"  # "batched" or "sequential" (reference, token by token)
    tree_budget: int = 0  # > 0: tree verification (DDTree) with this many drafted nodes; 0: chain
    tree_topk: int | None = None  # per-depth candidates of the tree (None: the budget)
    # n-gram lookup (`runtime/lookup.py`): a branch of up to `lookup_tokens` tokens (0: none) beside
    # the draft's, from the last match of the last n committed tokens, n from max down to min
    lookup_tokens: int = 0
    lookup_min_ngram: int = DEFAULT_LOOKUP_NGRAM[0]
    lookup_max_ngram: int = DEFAULT_LOOKUP_NGRAM[1]

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.verify_mode not in ("batched", "sequential"):
            raise ConfigError(f"verify_mode must be 'batched' or 'sequential', got {self.verify_mode!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ConfigError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.tree_budget, int) or self.tree_budget < 0:
            raise ConfigError(f"tree_budget must be an integer >= 0 (0 = chain), got {self.tree_budget!r}")
        if self.tree_topk is not None and (not isinstance(self.tree_topk, int) or self.tree_topk < 1):
            raise ConfigError(f"tree_topk must be an integer >= 1, got {self.tree_topk!r}")
        if not isinstance(self.lookup_tokens, int) or isinstance(self.lookup_tokens, bool) or \
                not 0 <= self.lookup_tokens <= MAX_LOOKUP_TOKENS:
            raise ConfigError(f"lookup_tokens must be an integer in 0..{MAX_LOOKUP_TOKENS} (0 = no lookup; each "
                              f"token is a verify row), got {self.lookup_tokens!r}")
        for name in ("lookup_min_ngram", "lookup_max_ngram"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.lookup_min_ngram > self.lookup_max_ngram:
            raise ConfigError(f"lookup_min_ngram ({self.lookup_min_ngram}) is above lookup_max_ngram "
                              f"({self.lookup_max_ngram})")
        if self.lookup_tokens and self.verify_mode != "batched":
            raise ConfigError("an n-gram lookup branch is verified as a tree, in one batched forward; "
                              "verify_mode must be 'batched'")
        if self.tree_budget and self.verify_mode != "batched":
            raise ConfigError("tree verification runs in one batched forward; verify_mode must be 'batched'")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
