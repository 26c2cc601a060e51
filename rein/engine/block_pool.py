"""The KV cache's block bookkeeping: which fixed-size blocks are free, and who holds which.

No torch here: blocks are plain integer ids into the cache tensors owned by the model
runner, so this module is testable anywhere. Requests get blocks as their tokens grow
(never their maximum length up front) and give them back on finish, abort or preemption.
Reference counts let several requests share a block (prefix sharing builds on this).
"""

from __future__ import annotations

from collections import deque


class BlockPoolExhausted(RuntimeError):
    """Not enough free blocks; the scheduler answers by preempting or waiting."""


class BlockPool:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0.0 to 1.0."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks (reference count 1 each), or raise BlockPoolExhausted."""
        if count > len(self._free):
            raise BlockPoolExhausted(f"need {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add a holder to blocks already allocated."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} is not allocated and cannot be shared")
            self._ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder from each block; a block with no holder goes back to the pool."""
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise ValueError(f"block {block} freed more often than it was allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
