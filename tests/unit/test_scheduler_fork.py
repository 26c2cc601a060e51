"""The scheduler's side of n > 1 (no model, no torch): sequence slots kept for future
choices, the fork's block sharing and copy list, and choices deferred when nothing is free."""

from __future__ import annotations

import random

import pytest

from rein.engine.block_pool import BlockPool
from rein.engine.request import ChoiceGroup, Request, RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler


def group_request(rid: str, prompt_len: int, n: int, max_tokens: int = 10) -> Request:
    request = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(n=n, max_tokens=max_tokens))
    request.group = ChoiceGroup(n)
    request.group.choices.append(request)
    return request


def children_of(parent: Request) -> list[Request]:
    children = [Request(parent.request_id, parent.prompt_token_ids, parent.sampling_params, index=i,
                        group=parent.group, arrival_order=parent.arrival_order) for i in range(1, parent.group.n)]
    parent.group.choices.extend(children)
    return children


def prefill(scheduler: Scheduler, parent: Request) -> None:
    while True:
        plan = scheduler.schedule()
        for s in plan.scheduled:
            s.request.num_computed_tokens = s.end
        if any(s.samples and s.request is parent for s in plan.scheduled):
            return


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    pool = BlockPool(32, 4)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    parent = group_request("p", 10, n=3)        # blocks: 4 + 4 + 2 tokens
    scheduler.add(parent)
    prefill(scheduler, parent)
    assert scheduler._reserved_seqs == 2
    children = children_of(parent)
    copies = scheduler.fork(parent, children)
    assert parent.group.forked and scheduler._reserved_seqs == 0
    assert [c.status for c in children] == [RequestStatus.RUNNING] * 2
    assert [src for src, _ in copies] == [parent.block_ids[2]] * 2
    assert [c.block_ids[2] for c in children] == [dst for _, dst in copies]
    for c in children:
        assert c.block_ids[:2] == parent.block_ids[:2] and c.num_computed_tokens == 10
    assert [pool.ref_count(b) for b in parent.block_ids] == [3, 3, 1]
    assert pool.num_used == 2 + 3
    for request in [parent, *children]:
        scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert pool.num_free == pool.num_blocks


def test_fork_on_a_block_boundary_copies_nothing():
    pool = BlockPool(32, 4)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    parent = group_request("p", 8, n=4)
    scheduler.add(parent)
    prefill(scheduler, parent)
    assert scheduler.fork(parent, children_of(parent)) == []
    assert [pool.ref_count(b) for b in parent.block_ids] == [4, 4]


def test_choices_without_a_free_block_or_slot_wait_and_recompute():
    pool = BlockPool(4, 4)
    scheduler = Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=100)
    parent = group_request("p", 10, n=4)        # 3 blocks; one free for one copy
    scheduler.add(parent)
    prefill(scheduler, parent)
    children = children_of(parent)
    copies = scheduler.fork(parent, children)
    assert len(copies) == 1
    assert [c.status for c in children] == [RequestStatus.RUNNING] + [RequestStatus.PREEMPTED] * 2
    assert all(c.num_computed_tokens == 0 and not c.block_ids for c in children[1:])
    assert scheduler.num_waiting == 2
    assert pool.num_free == 0


def test_admission_keeps_slots_for_the_choices_to_come():
    pool = BlockPool(64, 4)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    single = Request("s", [1, 2, 3], SamplingParams(max_tokens=50))
    big = group_request("g", 5, n=3)
    later = Request("l", [1, 2], SamplingParams(max_tokens=5))
    for r in (single, big, later):
        scheduler.add(r)
    scheduler.schedule()
    # single + big (with 2 slots kept) fill the 4 sequences: `later` must wait.
    assert single.status == big.status == RequestStatus.RUNNING
    assert later.status == RequestStatus.WAITING
    # Preempting the unforked request gives its slots back.
    scheduler.running.remove(big)
    scheduler._preempt(big)
    assert scheduler._reserved_seqs == 0


@pytest.mark.parametrize("n", [5, 8])
def test_a_request_with_more_choices_than_sequences_runs_alone(n):
    pool = BlockPool(64, 4)
    scheduler = Scheduler(pool, max_num_seqs=4, max_num_batched_tokens=100)
    other = Request("o", [1, 2, 3], SamplingParams(max_tokens=50))
    big = group_request("g", 6, n=n)
    scheduler.add(other)
    scheduler.add(big)
    scheduler.schedule()
    assert big.status == RequestStatus.WAITING   # no room for n choices beside `other`
    scheduler.finish(other, RequestStatus.FINISHED_LENGTH)
    prefill(scheduler, big)
    assert big.status == RequestStatus.RUNNING
    children = children_of(big)
    scheduler.fork(big, children)
    assert len(scheduler.running) == 4
    assert sum(c.status == RequestStatus.PREEMPTED for c in children) == n - 4


@pytest.mark.parametrize("seed", range(4))
def test_randomized_forks_leak_no_block_and_no_slot(seed):
    rng = random.Random(seed)
    pool = BlockPool(16, 4)
    scheduler = Scheduler(pool, max_num_seqs=6, max_num_batched_tokens=rng.choice([5, 16, 64]))
    live: list[Request] = []
    for i in range(300):
        op = rng.random()
        if op < 0.25:
            n = rng.choice([1, 2, 3, 7])
            r = group_request(f"r{i}", rng.randint(1, 20), n, rng.randint(1, 12)) if n > 1 else \
                Request(f"r{i}", list(range(1, rng.randint(2, 20))), SamplingParams(max_tokens=rng.randint(1, 12)))
            scheduler.add(r)
            live.append(r)
        elif op < 0.35 and live:
            victim = rng.choice(live)
            for c in victim.group.choices if victim.group else [victim]:
                scheduler.finish(c, RequestStatus.FINISHED_ABORTED)
            if victim.group:
                victim.group.forked = True
        else:
            plan = scheduler.schedule()
            assert len(scheduler.running) <= 6
            for s in plan.scheduled:
                s.request.num_computed_tokens = s.end
            for s in plan.scheduled:
                r = s.request
                if not s.samples or r.is_finished:
                    continue
                batch = [r]
                if r.num_unforked_choices:
                    children = children_of(r)
                    scheduler.fork(r, children)
                    batch += children
                for c in batch:
                    c.output_token_ids.append(rng.randrange(100))
                    if c.num_output_tokens >= c.sampling_params.max_tokens:
                        scheduler.finish(c, RequestStatus.FINISHED_LENGTH)
            held = {b for r in scheduler.running for b in r.block_ids}
            assert len(held) == pool.num_used
            for b in held:
                assert pool.ref_count(b) == sum(r.block_ids.count(b) for r in scheduler.running)
    for r in live:   # abort what is left, every choice
        for c in r.group.choices if r.group else [r]:
            scheduler.finish(c, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    assert pool.num_free == pool.num_blocks
    assert scheduler._reserved_seqs == 0
