"""The windowed layers' block map (rein.engine.window_blocks) and the scheduler's use of it,
without a model or torch: what is held, passed, kept evictable for the prefix cache, evicted,
and that running requests never hold more than the capacity bound."""

from __future__ import annotations

import random

import pytest

from rein.engine.block_pool import ROOT, BlockPool
from rein.engine.request import ChoiceGroup, Request, RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.engine.window_blocks import WindowBlocks, WindowPoolExhausted
from rein.model.capacity import windowed_pool_bound


def _request(rid: str, prompt: list[int], max_tokens: int = 8, n: int = 1, priority: int = 0) -> Request:
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, n=n), priority=priority)
    if n > 1:
        request.group = ChoiceGroup(n)
        request.group.choices.append(request)
    return request


def _held_run(windows: WindowBlocks, request: Request) -> list[int]:
    return request.block_ids[request.window_first:request.window_end]


def _compute(windows: WindowBlocks, request: Request, end: int) -> None:
    """What a step does for one request: cover, compute, advance (no prefix cache)."""
    missing = -(-end // windows.block_size) - len(request.block_ids)
    request.block_ids.extend(windows.pool.allocate(max(0, missing)))
    windows.cover(request, end)
    request.num_computed_tokens = end
    windows.advance(request)


def test_a_growing_request_holds_only_its_window():
    pool = BlockPool(64, 4)
    windows = WindowBlocks(pool, 8, window=8)
    request = _request("a", range(1, 3))
    for end in range(1, 200):
        _compute(windows, request, end)
        # The next query at `end` reads keys end-7..end: blocks from first_needed(end) on.
        assert request.window_first == windows.first_needed(end)
        assert windows.num_held == len(_held_run(windows, request)) <= 8 // 4 + 1
    assert len(request.block_ids) == 50 and windows.peak_held == 3
    windows.release(request)
    pool.free(request.block_ids)
    assert windows.num_held == 0 and windows.num_evictable == 0
    assert all(windows.physical[b] == -1 for b in request.block_ids)


def test_first_needed_is_the_block_of_the_oldest_visible_key():
    windows = WindowBlocks(BlockPool(4, 4), 2, window=6)
    # A query at p sees keys p-5..p.
    assert [windows.first_needed(p) for p in (0, 5, 6, 9, 10, 13)] == [0, 0, 0, 1, 1, 2]


def test_a_passed_cached_block_stays_evictable_and_is_revived_by_a_hit():
    pool = BlockPool(16, 4, enable_caching=True)
    windows = WindowBlocks(pool, 6, window=4)
    request = _request("a", range(1, 17))
    _compute(windows, request, 4)
    parent = pool.cache_block(request.block_ids[0], ROOT, request.tokens(0, 4))
    _compute(windows, request, 8)
    pool.cache_block(request.block_ids[1], parent, request.tokens(4, 8))
    _compute(windows, request, 12)
    first, second = request.block_ids[:2]
    # Blocks 0 and 1 were cached when the window (positions 9..12 for the next query) passed
    # them: their data stays, evictable.
    assert windows.holders(first) == windows.holders(second) == 0 and windows.physical[first] >= 0
    assert windows.num_evictable == 2
    # A new request finds both blocks; its first query (position 8) reads block 1 only.
    hit = pool.find_prefix(request.tokens(0, 8), 2)
    assert hit == [first, second] and windows.usable_prefix(hit) == 2
    other = _request("b", request.tokens(0, 10))
    pool.share(hit)
    other.block_ids = list(hit)
    windows.take(other, 2)
    assert _held_run(windows, other) == [second] and windows.holders(second) == 1
    # Block 0's data is not needed by anyone but stays findable.
    assert windows.num_evictable == 1 and windows.physical[first] >= 0


def test_a_hit_is_trimmed_to_the_blocks_whose_window_data_is_left():
    pool = BlockPool(16, 4, enable_caching=True)
    windows = WindowBlocks(pool, 3, window=4)
    request = _request("a", range(1, 33))
    parent = ROOT
    for i in range(6):
        _compute(windows, request, 4 * (i + 1))
        parent = pool.cache_block(request.block_ids[i], parent, request.tokens(4 * i, 4 * (i + 1)))
    # Three windowed blocks: the oldest evictable ones were lent again as the request grew.
    with_data = [windows.physical[b] >= 0 for b in request.block_ids]
    assert with_data == [False, False, False, True, True, True]
    hit = pool.find_prefix(request.tokens(0, 24), 6)
    assert len(hit) == 6
    # n = 6 reads block 5 only (a query at 24 sees 21..24), which is there; so on down to 4.
    assert [windows.usable_prefix(hit[:n]) for n in (6, 5, 4)] == [6, 5, 4]
    assert windows.usable_prefix(hit[:3]) == 0     # reads block 2, gone; so do all shorter hits


def test_evictable_data_goes_when_the_pool_hands_its_block_out_or_forgets_it():
    pool = BlockPool(4, 4, enable_caching=True)
    windows = WindowBlocks(pool, 4, window=4)
    request = _request("a", range(1, 13))
    _compute(windows, request, 4)
    parent = pool.cache_block(request.block_ids[0], ROOT, request.tokens(0, 4))
    _compute(windows, request, 8)
    pool.cache_block(request.block_ids[1], parent, request.tokens(4, 8))
    windows.release(request)
    pool.free(request.block_ids)
    assert windows.num_evictable == 2 and windows.num_held == 0
    # Free blocks are handed out least recently freed first: blocks 2 and 3, then block 0.
    pool.allocate(3)
    assert windows.num_evictable == 1 and windows.physical[request.block_ids[0]] == -1
    pool.reset_cache()
    assert windows.num_evictable == 0 and all(p == -1 for p in windows.physical)


def test_the_windowed_storage_lends_evictable_blocks_least_recently_freed_first_and_then_refuses():
    pool = BlockPool(16, 4, enable_caching=True)
    windows = WindowBlocks(pool, 2, window=1)
    cached = pool.allocate(2)
    parent = ROOT
    for i, block in enumerate(cached):
        parent = pool.cache_block(block, parent, [i] * 4)
    holder = _request("a", [1])
    holder.block_ids = list(cached)
    windows.cover(holder, 8)
    windows.release(holder)
    assert windows.num_evictable == 2
    other = _request("b", [1])
    other.block_ids = pool.allocate(2)
    windows.cover(other, 4)
    assert windows.physical[cached[0]] == -1 and windows.physical[cached[1]] >= 0
    windows.cover(other, 8)
    with pytest.raises(WindowPoolExhausted):
        third = _request("c", [1])
        third.block_ids = pool.allocate(1)
        windows.cover(third, 4)


def _step(scheduler: Scheduler, rng: random.Random, bound: int) -> None:
    """An engine step without a model: schedule, compute, register, advance, sample, fork."""
    windows, pool = scheduler.windows, scheduler.pool
    plan = scheduler.schedule()
    assert windows.num_held <= bound
    for s in plan.scheduled:
        r = s.request
        # Every block the step's queries read or write has windowed data.
        for block in r.block_ids[windows.first_needed(s.start):-(-s.end // pool.block_size)]:
            assert windows.physical[block] >= 0 and windows.holders(block) > 0
        r.num_computed_tokens = s.end
        if pool.enable_caching:
            scheduler.register_computed_blocks(r)
        windows.advance(r)
    for s in plan.scheduled:
        r = s.request
        if not s.samples or r.is_finished:
            continue
        batch = [r]
        if r.num_unforked_choices:
            children = [Request(r.request_id, r.prompt_token_ids, r.sampling_params, index=i, group=r.group,
                                arrival_order=r.arrival_order) for i in range(1, r.group.n)]
            r.group.choices.extend(children)
            scheduler.fork(r, children)
            batch += children
        for c in batch:
            c.output_token_ids.append(rng.randrange(3))
            if c.num_output_tokens >= c.sampling_params.max_tokens:
                scheduler.finish(c, RequestStatus.FINISHED_LENGTH)
    # The counts are exactly the running requests' runs.
    counts: dict[int, int] = {}
    for r in scheduler.running:
        for block in _held_run(windows, r):
            counts[block] = counts.get(block, 0) + 1
    assert all(windows.holders(b) == c for b, c in counts.items())
    assert windows.num_held == len(counts)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_workloads_stay_within_the_bound_and_leak_nothing(seed):
    rng = random.Random(seed)
    block_size, window, seqs, budget = 4, rng.choice([3, 8, 13]), 5, rng.choice([6, 16, 40])
    bound = windowed_pool_bound(window, block_size, seqs, budget)
    pool = BlockPool(rng.choice([14, 40]), block_size, enable_caching=True)
    windows = WindowBlocks(pool, bound, window)
    scheduler = Scheduler(pool, max_num_seqs=seqs, max_num_batched_tokens=budget, windows=windows)
    # Prompts from a few shared prefixes, so the prefix cache hits (and is trimmed).
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    live: list[Request] = []
    hits = 0
    for i in range(250):
        op = rng.random()
        if op < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(0, 9))]
            request = _request(f"r{i}", prompt, rng.randint(1, 30), n=rng.choice([1, 1, 2, 3]),
                               priority=rng.randint(0, 1))
            scheduler.add(request)
            live.append(request)
        elif op < 0.3 and live:
            victim = rng.choice(live)
            for c in victim.group.choices if victim.group else [victim]:
                scheduler.finish(c, RequestStatus.FINISHED_ABORTED)
            if victim.group:
                victim.group.forked = True
        else:
            _step(scheduler, rng, bound)
        hits = max(hits, sum(r.num_cached_tokens > 0 for r in live))
        live = [r for r in live if not all(c.is_finished for c in (r.group.choices if r.group else [r]))]
    for r in live:
        for c in r.group.choices if r.group else [r]:
            scheduler.finish(c, RequestStatus.FINISHED_ABORTED)
    assert windows.num_held == 0 and pool.num_free == pool.num_blocks
    assert windows.peak_held <= bound
    assert scheduler.num_preemptions > 0 or pool.num_blocks == 40
    assert hits > 0


def test_a_recomputed_twin_passes_its_windowed_data_to_the_cached_block():
    pool = BlockPool(16, 4, enable_caching=True)
    bound = windowed_pool_bound(4, 4, 1, 4)
    windows = WindowBlocks(pool, bound, window=4)
    scheduler = Scheduler(pool, max_num_seqs=1, max_num_batched_tokens=4, windows=windows)
    rng = random.Random(0)

    def run(request: Request) -> None:
        scheduler.add(request)
        while scheduler.has_unfinished():
            _step(scheduler, rng, bound)

    first = _request("a", range(1, 10), max_tokens=1)
    run(first)
    cached = pool.find_prefix(first.tokens(0, 8), 2)
    assert len(cached) == 2 and windows.usable_prefix(cached) == 2
    # A longer request lends every windowed block again, evicting the first one's data.
    run(_request("b", range(20, 40), max_tokens=1))
    assert windows.usable_prefix(cached) == 0
    # The same prompt again: no usable hit, so recomputed into blocks of its own, whose
    # windowed data the cached twins take over.
    again = _request("c", range(1, 10), max_tokens=1)
    run(again)
    assert again.num_cached_tokens == 0
    assert pool.find_prefix(first.tokens(0, 8), 2) == cached and windows.usable_prefix(cached) == 2
