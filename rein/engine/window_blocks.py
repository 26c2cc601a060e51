"""The sliding-window layers' own KV storage: which logical blocks have a block there.

A windowed layer's query at position p reads keys at positions > p - window only, so once
a request's next query has moved past a block, its windowed layers never read that block
again, while its full-attention layers still do. So the two kinds of layer keep separate
caches: the full layers' caches are indexed by the block pool's logical block ids
(rein.engine.block_pool) as always; the windowed layers' smaller caches are indexed by
*windowed blocks*, which this module lends to logical blocks while some request's window
covers them.

Holders: a request holds, in the windowed storage, the run of its blocks from the one its
next query's window starts in to its last computed or about-to-be-written one
(`Request.window_first:window_end`). Blocks join that run when a step is about to write them
(`cover`) or when the request takes them from the prefix cache or from its parent choice
(`take`, `fork`); they leave it when the window passes them after a step (`advance`) and all
at once when the request finishes or is preempted (`release`). A windowed block goes back
when its logical block's last holder lets go, unless that logical block stays in the prefix
cache: then its windowed data stays, *evictable*, so a later request can reuse the prefix
(`usable_prefix` trims a hit to what still has its windowed data). Evictable blocks are
lent again least recently freed first when no free one is left, and dropped when the block
pool hands their logical block out again or forgets it (`BlockPool.on_uncache`).

Twins: a request whose hit was trimmed recomputes blocks the prefix cache already holds; the
cache keeps its first block for those tokens (BlockPool.cache_block), which lacks windowed
data, and the request's own copy is not cached. So that the next request hits, the own
copy's windowed block passes to the cached twin when the request lets go of it (`twin`).

The storage is sized from a bound on what running requests can hold at once
(`capacity.windowed_pool_bound`), so it never runs dry and the scheduler needs no rule of its
own for it; running out anyway is a bug, reported as WindowPoolExhausted.

Its one owner is the KV cache manager (rein.engine.kv_cache_manager), which makes it beside
the block pool and calls it as the scheduler's requests take, grow and let go of blocks; the
model runner only reads `physical` (the manager's `window_map`). No torch here, like the
block pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from rein.engine.block_pool import BlockPool
from rein.engine.request import Request


class WindowPoolExhausted(RuntimeError):
    """The windowed storage has no block left: its size bound was wrong."""


class WindowBlocks:
    """`num_blocks` windowed blocks lent to the logical blocks of `pool` (see the module docstring)."""

    def __init__(self, pool: BlockPool, num_blocks: int, window: int) -> None:
        if num_blocks < 1 or window < 1:
            raise ValueError(f"windowed storage needs a block and a window, got {num_blocks} blocks, window {window}")
        self.pool = pool
        self.num_blocks = num_blocks
        self.window = window
        self.block_size = pool.block_size
        # Per logical block: its windowed block (-1: none) and how many requests hold it.
        # Public for the model runner, which translates block tables through it every step.
        self.physical: list[int] = [-1] * pool.num_blocks
        self._holders = [0] * pool.num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        # Logical blocks with windowed data and no holder, still in the prefix cache;
        # least recently freed first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Own logical block -> (its cached twin, the twin's generation): see the module docstring.
        self._twins: dict[int, tuple[int, int]] = {}
        self.peak_held = 0   # the most windowed blocks held at once (tests check it against the bound)
        pool.on_uncache = self._uncached

    @property
    def num_held(self) -> int:
        """Windowed blocks some request holds."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def holders(self, logical: int) -> int:
        return self._holders[logical]

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at `position` reads (it sees keys > position - window)."""
        return max(0, position - self.window + 1) // self.block_size

    # -- a request's run of held blocks --------------------------------------------------------

    def usable_prefix(self, blocks: Sequence[int]) -> int:
        """The largest n <= len(blocks) such that a request taking blocks[:n] from the prefix
        cache finds the windowed data its first new query reads (the blocks from
        first_needed(n * block_size) to n)."""
        n = len(blocks)
        physical = self.physical
        while n:
            missing = next((i for i in range(n - 1, self.first_needed(n * self.block_size) - 1, -1)
                            if physical[blocks[i]] < 0), None)
            if missing is None:
                return n
            n = missing   # any longer hit still reads the missing block
        return 0

    def take(self, request: Request, num_blocks: int) -> None:
        """The request took its first `num_blocks` blocks from the prefix cache (trimmed by
        `usable_prefix`): hold those its first new query reads."""
        first = self.first_needed(num_blocks * self.block_size)
        for block in request.block_ids[first:num_blocks]:
            self._hold(block)
        request.window_first, request.window_end = first, num_blocks

    def cover(self, request: Request, end: int) -> None:
        """A step is about to compute the request's positions up to `end`: hold every block
        they are written to."""
        last = -(-end // self.block_size)
        if last > request.window_end:
            for block in request.block_ids[request.window_end:last]:
                self._hold(block)
            request.window_end = last

    def advance(self, request: Request) -> None:
        """After a step: let go of the blocks the request's next query no longer reads."""
        first = min(self.first_needed(request.num_computed_tokens), request.window_end)
        if first > request.window_first:
            for block in request.block_ids[request.window_first:first]:
                self._drop(block)
            request.window_first = first

    def release(self, request: Request) -> None:
        """The request finished or was preempted: let go of all it holds (before its logical
        blocks go back to the pool)."""
        for block in request.block_ids[request.window_first:request.window_end]:
            self._drop(block)
        request.window_first = request.window_end = 0

    def fork(self, parent: Request, child: Request) -> None:
        """`child` shares the parent's blocks (and has its own copy of a partly filled last
        one, rein.engine.scheduler.fork): it holds the same run as its parent."""
        for block in child.block_ids[parent.window_first:]:
            self._hold(block)
        child.window_first, child.window_end = parent.window_first, len(child.block_ids)

    def twin(self, own: int, cached: int) -> None:
        """The prefix cache keeps `cached` for the tokens the held block `own` was just computed
        with: if `cached` lacks windowed data, it gets own's when own is let go of."""
        if self.physical[cached] < 0:
            self._twins[own] = (cached, self.pool.generation(cached))

    # -- one logical block -------------------------------------------------------------------

    def _hold(self, logical: int) -> None:
        count = self._holders[logical]
        self._holders[logical] = count + 1
        if count:
            return
        if self.physical[logical] < 0:
            self.physical[logical] = self._lend()
        else:
            del self._evictable[logical]
        held = self.num_held
        if held > self.peak_held:
            self.peak_held = held

    def _lend(self) -> int:
        if self._free:
            return self._free.pop()
        if not self._evictable:
            raise WindowPoolExhausted(
                f"all {self.num_blocks} windowed KV blocks are held by running requests; "
                f"their bound (rein.model.capacity.windowed_pool_bound) should have prevented that")
        logical, _ = self._evictable.popitem(last=False)
        block, self.physical[logical] = self.physical[logical], -1
        return block

    def _drop(self, logical: int) -> None:
        count = self._holders[logical] - 1
        if count < 0:
            raise ValueError(f"logical block {logical} let go of more often than held in the windowed storage")
        self._holders[logical] = count
        if count == 0:
            pool = self.pool
            if pool.is_cached(logical):
                self._evictable[logical] = None
                return
            block, self.physical[logical] = self.physical[logical], -1
            twin, generation = self._twins.pop(logical, (-1, -1))
            # The same tokens after the same prefix: valid for the twin while it holds them.
            if twin >= 0 and pool.is_cached(twin) and pool.generation(twin) == generation \
                    and self.physical[twin] < 0:
                self.physical[twin] = block
                self._evictable[twin] = None
            else:
                self._free.append(block)

    def _uncached(self, logical: int) -> None:
        # The logical block left the prefix cache: its windowed data, if no one holds it, can
        # no longer be reached.
        if self._holders[logical] == 0 and self.physical[logical] >= 0:
            del self._evictable[logical]
            self._free.append(self.physical[logical])
            self.physical[logical] = -1
