"""The KV cache's blocks, one owner: the block pool (rein.engine.block_pool) and the
sliding-window layers' own storage (rein.engine.window_blocks) kept in step, as vLLM v1's
KV cache coordinator keeps its full-attention and sliding-window managers.

The scheduler holds a `KVCacheManager` and asks it for what a request needs: blocks for the
tokens a step will compute (`allocate`), a prefix-cache hit (`find_cached`, `take_cached`),
a fork's shared blocks (`fork`), the bookkeeping after a step (`mark_computed`: register the
newly full blocks in the prefix cache, let the windows move on) and freeing (`free`). It
never indexes the pool or the windowed map itself.

The model runner reads from it what a step needs beyond each request's `block_ids`: the
windowed block map (`window_map`, logical block -> windowed block) and the block copies the
forks queued since the last step (`take_copies`), which it makes before that step's forward
pass (nothing reads or writes those blocks in between).

Windowed layers, when the model runner gave them storage of their own: this module tells it
which blocks each step writes (`cover`), which blocks a request takes from the prefix cache
or its parent choice, and which it lets go of. A prefix hit is trimmed to the blocks whose
windowed data is still there for the first new query's window. That storage is sized so that
running requests never exhaust it: batching and preemption are decided by the block pool
alone, as for a model without windows.

No torch here, like the pool and the windowed map.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import NamedTuple

from rein.engine.block_pool import BlockPool
from rein.engine.request import Request
from rein.engine.window_blocks import WindowBlocks

# Read of every running request every step (slot_utilization): attrgetter through map spares
# a generator's frame per request.
_BLOCK_IDS = attrgetter("block_ids")
_COMPUTED = attrgetter("num_computed_tokens")


class BlockCopies(NamedTuple):
    """KV blocks to copy, source -> destination, before the next forward pass (n > 1 forks);
    `windowed`: the same copies in the windowed storage (None when it has none)."""

    pairs: list[tuple[int, int]]
    windowed: list[tuple[int, int]] | None


class KVCacheManager:
    """The block pool and, when the windowed layers have storage of their own, its windowed
    map (see the module docstring)."""

    def __init__(self, pool: BlockPool, windows: WindowBlocks | None = None) -> None:
        if windows is not None and windows.pool is not pool:
            raise ValueError("the windowed blocks must map the manager's own block pool")
        self.pool = pool
        self.windows = windows
        self.block_size = pool.block_size
        self.enable_caching = pool.enable_caching
        self._copies: list[tuple[int, int]] = []
        self._windowed_copies: list[tuple[int, int]] = []

    @classmethod
    def create(cls, num_blocks: int, block_size: int, enable_caching: bool = False,
               num_windowed_blocks: int = 0, window: int | None = None) -> KVCacheManager:
        """A pool of `num_blocks` blocks and, when `num_windowed_blocks` > 0, the windowed
        layers' storage of that many blocks for a window of `window` tokens."""
        pool = BlockPool(num_blocks, block_size, enable_caching=enable_caching)
        windows = WindowBlocks(pool, num_windowed_blocks, window) if num_windowed_blocks else None
        return cls(pool, windows)

    # -- views ----------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of blocks in use, 0.0 to 1.0 (metrics, `rein top`)."""
        return self.pool.usage

    @property
    def window_map(self) -> list[int] | None:
        """Logical block -> its windowed block (-1: none), or None when every layer is indexed
        by the pool's blocks. Read-only for the model runner, which translates each step's slots
        and block tables through it."""
        return self.windows.physical if self.windows is not None else None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot_utilization(self, requests: Sequence[Request]) -> float | None:
        """Tokens whose K/V the requests keep against the slots their blocks provide (only a
        last, partly filled block wastes any); None without blocks."""
        slots = sum(map(len, map(_BLOCK_IDS, requests))) * self.block_size
        if not slots:
            return None
        return sum(map(_COMPUTED, requests)) / slots

    # -- admission and growth ---------------------------------------------------------------------

    def find_cached(self, request: Request, max_blocks: int) -> list[int]:
        """The cached blocks holding the request's first n full blocks of tokens, for the largest
        n <= max_blocks whose windowed data (if any) is still there. Takes nothing."""
        if max_blocks <= 0:
            return []
        cached = self.pool.find_prefix(request.key_tokens(0, max_blocks * self.block_size), max_blocks,
                                       request.cache_root)
        if cached and self.windows is not None:
            del cached[self.windows.usable_prefix(cached):]
        return cached

    def can_allocate(self, num_blocks: int, cached: Sequence[int] = ()) -> bool:
        """Whether `num_blocks` new blocks plus taking `cached` (found by find_cached) fit now."""
        return num_blocks + self.pool.num_unheld(cached) <= self.pool.num_free

    def take_cached(self, request: Request, blocks: list[int]) -> None:
        """Give a request with no blocks the cached `blocks` as its first ones (registered already)."""
        self.pool.share(blocks)
        request.block_ids = list(blocks)
        request.num_registered_blocks = len(blocks)
        request.cache_parent = (blocks[-1], self.pool.generation(blocks[-1]))
        if self.windows is not None:
            self.windows.take(request, len(blocks))

    def allocate(self, request: Request, num_blocks: int) -> None:
        """Add `num_blocks` new blocks to the request's (BlockPoolExhausted if they are not free)."""
        if num_blocks > 0:
            request.block_ids.extend(self.pool.allocate(num_blocks))

    def cover(self, requests: Iterable[tuple[Request, int]]) -> None:
        """A step is about to compute each (request, up to position end): its windowed layers
        hold every block written."""
        if self.windows is not None:
            for request, end in requests:
                self.windows.cover(request, end)

    # -- after a step ------------------------------------------------------------------------------

    def mark_computed(self, request: Request) -> None:
        """A step computed the request's tokens up to `num_computed_tokens`: offer its newly
        full blocks to the prefix cache, then let go of the windowed blocks its next query no
        longer reads (after registering: a cached block's windowed data may stay)."""
        if self.enable_caching and request.num_computed_tokens // self.block_size > request.num_registered_blocks:
            self.register_computed(request)
        if self.windows is not None:
            self.windows.advance(request)

    def register_computed(self, request: Request) -> None:
        """Offer the request's newly completed blocks to the prefix cache."""
        size = self.block_size
        full = request.num_computed_tokens // size
        parent, tokens, blocks = request.cache_parent, request.key_tokens, request.block_ids
        windows = self.windows
        for i in range(request.num_registered_blocks, full):
            parent = self.pool.cache_block(blocks[i], parent, tokens(i * size, (i + 1) * size))
            if windows is not None and parent[0] != blocks[i]:   # cached already: see window_blocks
                windows.twin(blocks[i], parent[0])
        request.cache_parent = parent
        request.num_registered_blocks = full

    # -- forks ---------------------------------------------------------------------------------

    def can_fork(self, parent: Request) -> bool:
        """Whether a new choice of `parent` can get its blocks now: a free block for its copy of
        the parent's partly filled last block, if it has one."""
        return parent.num_computed_tokens % self.block_size == 0 or self.pool.num_free > 0

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the parent's full blocks (one more reference each) and a new block for
        the parent's partly filled last one, if any (check can_fork first); the copy that block
        needs is queued for the next step (take_copies) and returned."""
        size = self.block_size
        computed = parent.num_computed_tokens
        full = computed // size
        shared = parent.block_ids[:full]
        self.pool.share(shared)
        child.block_ids = list(shared)
        copy = None
        if computed % size:
            [block] = self.pool.allocate(1)
            child.block_ids.append(block)
            copy = (parent.block_ids[full], block)
        if self.windows is not None:
            self.windows.fork(parent, child)
        if copy is not None:
            self._copies.append(copy)
            if self.windows is not None:   # both blocks are held there now
                physical = self.windows.physical
                self._windowed_copies.append((physical[copy[0]], physical[copy[1]]))
        child.num_registered_blocks = parent.num_registered_blocks
        child.cache_parent = parent.cache_parent
        return copy

    def take_copies(self) -> BlockCopies | None:
        """The block copies queued since the last call (None if none), for the model runner."""
        if not self._copies:
            return None
        copies = BlockCopies(self._copies, self._windowed_copies if self.windows is not None else None)
        self._copies, self._windowed_copies = [], []
        return copies

    # -- freeing --------------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """The request finished or was preempted: all its blocks go back (cached ones stay
        findable in the prefix cache until handed out again)."""
        if self.windows is not None:
            self.windows.release(request)
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []
        request.num_registered_blocks = 0
        request.cache_parent = request.cache_root
