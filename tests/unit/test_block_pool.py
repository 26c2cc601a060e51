"""Block pool bookkeeping and the scheduler's use of it, without a model."""

from __future__ import annotations

import random

import pytest

from rein.engine.block_pool import BlockPool, BlockPoolExhausted
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
