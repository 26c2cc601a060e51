"""The KV cache's block bookkeeping: which fixed-size blocks are free, who holds which, and
which hold a known prefix (automatic prefix caching).

No torch here: blocks are plain integer ids into the cache tensors owned by the model
runner, so this module is testable anywhere. The KV cache manager
(rein.engine.kv_cache_manager) owns the pool and hands its blocks to the scheduler's
requests: they get blocks as their tokens grow (never their maximum length up front) and
give them back on finish, abort or preemption. Reference counts let several requests share
a block.

Prefix caching (`enable_caching`): a block whose slots are all computed is registered
under a key naming its exact contents — (its predecessor's block id and generation, its
tokens) — so a later request whose tokens start the same way finds the chain of blocks and
skips computing them. The keys compare the tokens themselves, so two different prefixes
can never share a block (no hash collisions). A block that no request holds stays cached
but counts as free: the pool hands free blocks out least recently freed first, and a
cached block handed out is dropped from the cache then. Each hand-out also bumps the
block's generation, so keys that named its old contents can no longer be reached.

LoRA adapters: K and V computed under an adapter differ from the base model's for the same
tokens, so each adapter's chains start from a root of their own (`prefix_root`): a prefix
computed under one adapter is found only by requests of that adapter.

`on_uncache`, when set, hears of every block that leaves the prefix cache (handed out
again, or forgotten by `reset_cache`): the windowed layers' storage
(rein.engine.window_blocks) keeps data for cached blocks and must drop it then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

# The predecessor of a request's first block: no block, generation 0.
ROOT: tuple[int, int] = (-1, 0)


def prefix_root(lora_int_id: int = 0) -> tuple[int, int]:
    """The predecessor of the first block of a request under LoRA adapter `lora_int_id` (0: the
    base model, ROOT): no block id is negative, so the roots of different adapters never meet."""
    return ROOT if lora_int_id == 0 else (-1 - lora_int_id, 0)

BlockKey = tuple[int, int, tuple[int, ...]]


class BlockPoolExhausted(RuntimeError):
    """Not enough free blocks; the scheduler answers by preempting or waiting."""


class BlockPool:
    """A pool of `num_blocks` KV blocks of `block_size` token slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Free blocks, least recently freed first (dict order); cached ones among them too.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._generations = [0] * num_blocks
        self.on_uncache: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they can be handed out)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

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
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._keys[block]
            if key is not None:   # evicted from the prefix cache
                del self._cached[key]
                self._keys[block] = None
                if self.on_uncache is not None:
                    self.on_uncache(block)
            self._generations[block] += 1
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Add a holder to each block: one already held, or a cached one no request holds."""
        for block in blocks:
            count = self._ref_counts[block]
            if count == 0:
                if self._keys[block] is None:
                    raise ValueError(f"block {block} is not allocated and cannot be shared")
                del self._free[block]
            self._ref_counts[block] = count + 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one holder from each block; a block with no holder goes back to the pool (a
        cached one stays findable until it is handed out again)."""
        for block in blocks:
            count = self._ref_counts[block]
            if count <= 0:
                raise ValueError(f"block {block} freed more often than it was allocated")
            self._ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def generation(self, block: int) -> int:
        return self._generations[block]

    def is_cached(self, block: int) -> bool:
        """Whether the block is registered in the prefix cache (findable by find_prefix)."""
        return self._keys[block] is not None

    # -- prefix caching ----------------------------------------------------------------------

    def find_prefix(self, tokens: Sequence[int], max_blocks: int, root: tuple[int, int] = ROOT) -> list[int]:
        """The cached blocks holding tokens[0 : n * block_size] for the largest n <= max_blocks
        (a chain from the first block, whose predecessor is `root`: `prefix_root` of the request's
        adapter; empty when caching is off). Takes nothing: `share` them."""
        if not self.enable_caching or not self._cached:
            return []
        size, cached, generations = self.block_size, self._cached, self._generations
        parent, found = root, []
        for i in range(max_blocks):
            block = cached.get((*parent, tuple(tokens[i * size:(i + 1) * size])))
            if block is None:
                break
            found.append(block)
            parent = (block, generations[block])
        return found

    def num_unheld(self, blocks: Sequence[int]) -> int:
        """How many of these (cached) blocks no request holds: sharing them uses free blocks."""
        return sum(1 for block in blocks if self._ref_counts[block] == 0)

    def cache_block(self, block: int, parent: tuple[int, int], tokens: Sequence[int]) -> tuple[int, int]:
        """Register a full block of `tokens` whose predecessor is `parent` (the request's root,
        `prefix_root`, for a first block); returns the (block, generation) to pass as the next block's parent. When the
        same prefix is cached already (another request computed it at the same time), that
        block stays the cached one and its link is returned, so the chain continues."""
        key = (*parent, tuple(tokens))
        existing = self._cached.get(key)
        if existing is None:
            if self._keys[block] is not None:   # already cached under another key: keep that
                return block, self._generations[block]
            self._cached[key] = block
            self._keys[block] = key
            existing = block
        return existing, self._generations[existing]

    def reset_cache(self) -> None:
        """Forget every cached prefix (the blocks stay where they are)."""
        uncached = list(self._cached.values())
        self._cached.clear()
        self._keys = [None] * self.num_blocks
        if self.on_uncache is not None:
            for block in uncached:
                self.on_uncache(block)
