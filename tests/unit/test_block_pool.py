"""Block pool bookkeeping and the scheduler's use of it, without a model."""

from __future__ import annotations

import random

import pytest

from rein.engine.block_pool import ROOT, BlockPool, BlockPoolExhausted
from rein.engine.request import Request, RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler


def test_allocate_and_free_round_trip():
    pool = BlockPool(4, 16)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1
    with pytest.raises(BlockPoolExhausted):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4


def test_shared_block_returns_after_last_holder():
    pool = BlockPool(2, 16)
    [block] = pool.allocate(1)
    pool.share([block])
    pool.free([block])
    assert pool.num_free == 1 and pool.ref_count(block) == 1
    pool.free([block])
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.free([block])


def test_blocks_for_rounds_up():
    pool = BlockPool(1, 16)
    assert [pool.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def _request(i: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Request:
    return Request(str(i), list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   priority=priority)


def _fake_step(scheduler: Scheduler, rng: random.Random) -> list[Request]:
    """What the engine does after a forward: advance computed tokens, 'sample' a token,
    finish requests at max_tokens. Returns those finished."""
    plan = scheduler.schedule()
    finished = []
    for s in plan.scheduled:
        assert s.start == s.request.num_computed_tokens
        s.request.num_computed_tokens = s.end
        assert len(s.request.block_ids) * scheduler.pool.block_size >= s.end
        if s.samples:
            s.request.output_token_ids.append(rng.randrange(100))
            if s.request.num_output_tokens >= s.request.sampling_params.max_tokens:
                scheduler.finish(s.request, RequestStatus.FINISHED_LENGTH)
                finished.append(s.request)
    held = sum(len(r.block_ids) for r in scheduler.running)
    assert held == scheduler.pool.num_used, "blocks in use must all belong to running requests"
    return finished


@pytest.mark.parametrize("seed", range(5))
def test_randomized_add_abort_step_leaks_nothing(seed):
    rng = random.Random(seed)
    pool = BlockPool(12, 4)  # 48 token slots: constant pressure and preemption
    scheduler = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=rng.choice([5, 16, 64]))
    live: list[Request] = []
    for i in range(300):
        op = rng.random()
        if op < 0.3:
            request = _request(i, rng.randint(1, 20), rng.randint(1, 20), priority=rng.randint(0, 2))
            scheduler.add(request)
            live.append(request)
        elif op < 0.4 and live:
            victim = rng.choice(live)
            scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
        else:
            _fake_step(scheduler, rng)
        live = [r for r in live if not r.is_finished]
    for request in live:
        scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    assert pool.num_free == pool.num_blocks
    assert scheduler.num_preemptions > 0


def test_waiting_queue_orders_by_priority_then_arrival():
    pool = BlockPool(64, 16)
    scheduler = Scheduler(pool, max_num_seqs=1, max_num_batched_tokens=1000)
    low_first = _request(1, 4, 1, priority=5)
    urgent = _request(2, 4, 1, priority=0)
    urgent_later = _request(3, 4, 1, priority=0)
    for r in (low_first, urgent, urgent_later):
        scheduler.add(r)
    order = []
    rng = random.Random(0)
    while scheduler.has_unfinished():
        order.extend(r.request_id for r in _fake_step(scheduler, rng))
    assert order == ["2", "3", "1"]


def test_preemption_takes_newest_running_request():
    pool = BlockPool(3, 4)  # 12 slots
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    old, new = _request(1, 4, 20), _request(2, 4, 20)
    scheduler.add(old)
    scheduler.add(new)
    rng = random.Random(0)
    _fake_step(scheduler, rng)  # both prefilled: 1 block each, one free
    assert old.status == new.status == RequestStatus.RUNNING
    for _ in range(6):
        _fake_step(scheduler, rng)
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.status == RequestStatus.RUNNING


def test_long_prompt_is_prefilled_in_chunks_beside_decodes():
    pool = BlockPool(64, 16)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=10)
    short = _request(1, 2, 50)
    scheduler.add(short)
    rng = random.Random(0)
    _fake_step(scheduler, rng)
    long = _request(2, 35, 5)
    scheduler.add(long)
    chunks = []
    for _ in range(4):
        plan = scheduler.schedule()
        by_id = {s.request.request_id: s for s in plan.scheduled}
        assert by_id["1"].num_new_tokens == 1, "the decoding request keeps going every step"
        chunks.append(by_id["2"].num_new_tokens)
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.end
            if s.samples:
                s.request.output_token_ids.append(0)
    assert chunks == [9, 9, 9, 8]


# --- prefix caching


def test_cached_chain_is_found_block_by_block_and_only_for_the_same_tokens():
    pool = BlockPool(8, 4, enable_caching=True)
    tokens = list(range(10, 22))   # 3 full blocks
    blocks = pool.allocate(3)
    parent = ROOT
    for i, block in enumerate(blocks):
        parent = pool.cache_block(block, parent, tokens[i * 4:(i + 1) * 4])
    assert pool.find_prefix(tokens, 3) == blocks
    assert pool.find_prefix(tokens + [99], 2) == blocks[:2]          # at most max_blocks
    assert pool.find_prefix(tokens[:4] + [0, 0, 0, 0], 3) == blocks[:1]   # diverges in block 2
    assert pool.find_prefix([0] + tokens[1:], 3) == []               # differs in the first token
    assert pool.find_prefix(tokens[4:8], 1) == []                    # same tokens, other position


def test_caching_off_finds_nothing():
    pool = BlockPool(4, 4)
    [block] = pool.allocate(1)
    pool.cache_block(block, ROOT, [1, 2, 3, 4])
    assert pool.find_prefix([1, 2, 3, 4], 1) == []


def test_freed_cached_blocks_count_as_free_revive_on_share_and_are_evicted_oldest_first():
    pool = BlockPool(3, 2, enable_caching=True)
    a, b = pool.allocate(2)
    link = pool.cache_block(a, ROOT, [1, 2])
    pool.cache_block(b, link, [3, 4])
    pool.free([a, b])
    assert pool.num_free == 3 and pool.num_cached == 2
    found = pool.find_prefix([1, 2, 3, 4], 2)
    assert found == [a, b] and pool.num_unheld(found) == 2
    pool.share(found)                          # revived: held again, no longer free
    assert pool.num_free == 1 and pool.ref_count(a) == 1
    pool.free(found)                           # a then b freed: a is the older
    [c] = pool.allocate(1)                     # the never-cached block goes first
    assert c not in (a, b) and pool.num_cached == 2
    [d] = pool.allocate(1)                     # then the least recently freed cached one: a
    assert d == a and pool.num_cached == 1
    # b's key named a as its predecessor; a now holds something else, so b is unreachable.
    assert pool.find_prefix([1, 2, 3, 4], 2) == []
    pool.cache_block(d, ROOT, [1, 2])          # the same first block again, a new generation
    assert pool.find_prefix([1, 2, 3, 4], 2) == [d]


def test_sharing_a_free_block_that_is_not_cached_is_refused():
    pool = BlockPool(2, 4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.share([0])


def test_a_prefix_cached_twice_keeps_the_first_block_and_the_chain_continues():
    pool = BlockPool(6, 2, enable_caching=True)
    first, second = pool.allocate(2)
    link_first = pool.cache_block(first, ROOT, [5, 6])
    link_second = pool.cache_block(second, ROOT, [5, 6])   # computed at the same time elsewhere
    assert link_second == link_first
    [tail] = pool.allocate(1)
    pool.cache_block(tail, link_second, [7, 8])
    assert pool.find_prefix([5, 6, 7, 8], 2) == [first, tail]


def _write(contents: dict[int, dict[int, int]], request: Request, start: int, end: int, size: int,
           pool: BlockPool) -> None:
    """Play the model: the K/V of positions [start, end) land in the request's blocks. No
    other request may hold a block that is written, and what is already computed must hold
    exactly the request's tokens (whether computed by it or found in the prefix cache)."""
    for pos in range(start):
        block = request.block_ids[pos // size]
        assert contents.get(block, {}).get(pos % size) == request.token_at(pos), "cached block holds other tokens"
    for pos in range(start, end):
        block = request.block_ids[pos // size]
        assert pool.ref_count(block) == 1, "a shared block is being written"
        contents.setdefault(block, {})[pos % size] = request.token_at(pos)


@pytest.mark.parametrize("seed", range(6))
def test_randomized_prefix_sharing_never_writes_shared_blocks_or_reads_other_tokens(seed):
    rng = random.Random(seed)
    size = 4
    pool = BlockPool(10, size, enable_caching=True)   # 40 slots: preemption under pressure
    scheduler = Scheduler(pool, max_num_seqs=5, max_num_batched_tokens=rng.choice([6, 16, 64]))
    # Few distinct beginnings, so prompts share prefixes of every length.
    stems = [[rng.randrange(1, 5) for _ in range(rng.randint(3, 14))] for _ in range(3)]
    contents: dict[int, dict[int, int]] = {}
    live: list[Request] = []
    hits = 0
    for i in range(400):
        op = rng.random()
        if op < 0.3:
            prompt = rng.choice(stems)[: rng.randint(1, 14)] + [rng.randrange(1, 5) for _ in range(rng.randint(0, 6))]
            request = Request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 16)))
            scheduler.add(request)
            live.append(request)
        elif op < 0.37 and live:
            scheduler.finish(rng.choice(live), RequestStatus.FINISHED_ABORTED)
        else:
            plan = scheduler.schedule()
            hits += plan.prefix_cache_hits
            for s in plan.scheduled:
                request = s.request
                assert s.start == request.num_computed_tokens
                _write(contents, request, s.start, s.end, size, pool)
                request.num_computed_tokens = s.end
                scheduler.register_computed_blocks(request)
                if s.samples:
                    request.output_token_ids.append(rng.randrange(1, 5))
                    if request.num_output_tokens >= request.sampling_params.max_tokens:
                        scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
            held = [b for r in scheduler.running for b in r.block_ids]
            assert len(set(held)) == pool.num_used
            for block in set(held):
                assert pool.ref_count(block) == held.count(block)
        live = [r for r in live if not r.is_finished]
    for request in live:
        scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished() and pool.num_free == pool.num_blocks
    assert hits > 0 and scheduler.num_preemptions > 0
