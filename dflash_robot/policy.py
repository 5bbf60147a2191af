"""Block-size policies: how many tokens the next iteration verifies.

The orchestrator asks `next_block_size(history)` before every iteration; `history` is
the acceptance lengths so far in this generation. A policy never exceeds its `max_block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class BlockSizePolicy(Protocol):
    max_block_size: int

    def next_block_size(self, history: Sequence[int]) -> int: ...


class FixedBlockSize:
    """Always the same block size; block size 1 is plain autoregressive decoding."""

    def __init__(self, block_size: int):
        self.max_block_size = block_size

    def next_block_size(self, history: Sequence[int]) -> int:
        return self.max_block_size
