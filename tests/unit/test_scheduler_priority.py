"""Priority that preempts, on the scheduler alone (no model, no torch): a better-priority
request takes a worse one's place when max_num_seqs or the block pool is full, the victim
resumes from its cached blocks, nothing is preempted without a reason, and the aging rule
keeps worse priorities from starving under a steady stream of better ones."""

from __future__ import annotations

import pytest
from scheduler_support import BATCH, INTERACTIVE, Driver, request

from rein.engine.block_pool import BlockPool
from rein.engine.request import Request, RequestStatus
from rein.engine.scheduler import Scheduler


def scheduled_ids(plan) -> set[str]:
    return {s.request.request_id for s in plan.scheduled}


def test_a_better_priority_takes_the_place_of_the_newest_worse_one_when_max_num_seqs_is_full():
    scheduler = Scheduler(BlockPool(64, 4, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    batch = [request(f"b{i}", first_token=i + 1) for i in range(4)]
    for r in batch:
        scheduler.add(r)
    driver.run(3)
    assert scheduler.num_running == 4
    urgent = request("urgent", priority=INTERACTIVE, first_token=9)
    scheduler.add(urgent)
    plan = driver.step()
    assert "urgent" in scheduled_ids(plan)                     # admitted in the very next step
    assert plan.preempted == [batch[3]] and plan.priority_preemptions == 1   # the last to arrive
    assert batch[3].status == RequestStatus.PREEMPTED and "b3" not in scheduled_ids(plan)
    assert scheduler.num_running == 4 and scheduler.num_priority_preemptions == 1
    # The victim resumes once there is room, starting after its cached full blocks.
    computed_before = 8 + 3                                    # prompt + 3 sampled tokens
    driver.run(60)
    resumed = next(s for p in driver.plans[4:] for s in p.scheduled if s.request is batch[3])
    assert resumed.start == (computed_before // 4) * 4 and resumed.start > 0
    assert set(driver.finished) == {"b0/0", "b1/0", "b2/0", "b3/0", "urgent/0"}
    assert batch[3].output_token_ids == [50_000 + i for i in range(20)]
    assert scheduler.pool.num_free == scheduler.pool.num_blocks


def test_a_better_priority_takes_blocks_when_the_pool_is_full():
    # 8 blocks of 4: two batch requests of 12 prompt tokens + decodes fill it.
    scheduler = Scheduler(BlockPool(8, 4), max_num_seqs=8, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    a, b = request("a", prompt_len=12, max_tokens=4, first_token=1), request("b", prompt_len=12, max_tokens=4,
                                                                              first_token=2)
    scheduler.add(a)
    scheduler.add(b)
    driver.step()
    assert scheduler.pool.num_free == 2
    urgent = request("urgent", prompt_len=12, max_tokens=2, priority=INTERACTIVE, first_token=3)
    scheduler.add(urgent)
    plan = driver.step()
    assert "urgent" in scheduled_ids(plan) and plan.preempted == [b]
    driver.run(30)
    assert set(driver.finished) == {"a/0", "b/0", "urgent/0"}
    assert driver.finished["urgent/0"] < driver.finished["b/0"]


def test_nothing_is_preempted_without_a_worse_priority_behind():
    scheduler = Scheduler(BlockPool(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    for i, priority in enumerate([INTERACTIVE, BATCH]):
        scheduler.add(request(f"r{i}", priority=priority, first_token=i + 1))
    driver.run(2)
    # Same priority as the worst running one, then a worse one: both wait.
    scheduler.add(request("same", priority=BATCH, first_token=5))
    scheduler.add(request("worse", priority=9, first_token=6))
    plan = driver.step()
    assert not plan.preempted and scheduled_ids(plan) == {"r0", "r1"}
    # A better one preempts the batch request, never the interactive one.
    scheduler.add(request("better", priority=INTERACTIVE, first_token=7))
    plan = driver.step()
    assert [r.request_id for r in plan.preempted] == ["r1"]
    assert scheduled_ids(plan) == {"r0", "better"}


def test_no_preemption_when_it_would_not_make_room():
    # The pool cannot hold the urgent prompt even with the batch request gone.
    scheduler = Scheduler(BlockPool(6, 4), max_num_seqs=4, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    scheduler.add(request("i", prompt_len=12, priority=INTERACTIVE, first_token=1))
    scheduler.add(request("b", prompt_len=4, priority=BATCH, first_token=2))
    driver.step()
    scheduler.add(request("big", prompt_len=16, priority=INTERACTIVE, first_token=3))
    plan = driver.step()
    assert not plan.preempted and scheduled_ids(plan) == {"i", "b"}


def test_aging_lets_batch_requests_finish_under_a_steady_stream_of_interactive_ones():
    def run(aging: int) -> dict[str, int]:
        scheduler = Scheduler(BlockPool(512, 4, enable_caching=True), max_num_seqs=2, max_num_batched_tokens=64,
                              priority_aging_steps=aging)
        driver = Driver(scheduler)
        for i in range(3):
            scheduler.add(request(f"batch{i}", max_tokens=5, first_token=i + 1))
        for step in range(300):
            # One interactive request per step: more than two sequences can serve, so
            # without aging they always outrank the batch requests.
            scheduler.add(request(f"chat{step}", max_tokens=3, priority=INTERACTIVE, first_token=100 + step))
            driver.step()
        return {rid: at for rid, at in driver.finished.items() if rid.startswith("batch")}

    assert run(aging=10**6) == {}                       # strict priority starves them
    finished = run(aging=4)
    assert set(finished) == {"batch0/0", "batch1/0", "batch2/0"}
    # Each is served about as if it had arrived 6 x 4 steps late, far from the 300 steps.
    assert max(finished.values()) < 120


def test_aged_running_requests_are_not_preempted_any_more():
    scheduler = Scheduler(BlockPool(64, 4), max_num_seqs=1, max_num_batched_tokens=64, priority_aging_steps=2)
    driver = Driver(scheduler)
    scheduler.add(request("old", max_tokens=30))
    driver.run(13)                                     # rank 6 x 2 + 0 = 12: older than any new arrival
    scheduler.add(request("chat", priority=INTERACTIVE, first_token=2))
    plan = driver.step()
    assert not plan.preempted and scheduled_ids(plan) == {"old"}


def test_an_unforked_n_request_preempted_for_priority_gives_back_its_kept_slots():
    scheduler = Scheduler(BlockPool(64, 4), max_num_seqs=4, max_num_batched_tokens=4)
    driver = Driver(scheduler)
    parent = request("n4", prompt_len=16, n=4)            # prefills in 4 chunks, keeping 3 slots
    scheduler.add(parent)
    driver.step()
    assert scheduler._reserved_seqs == 3 and not parent.group.forked
    scheduler.add(request("urgent", prompt_len=3, priority=INTERACTIVE, first_token=2))
    plan = driver.step()
    assert plan.preempted == [parent] and scheduler._reserved_seqs == 0
    assert scheduled_ids(plan) == {"urgent"}


def test_a_forked_choice_can_be_preempted_for_priority_and_resumes():
    scheduler = Scheduler(BlockPool(64, 4, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)
    driver = Driver(scheduler)
    parent = request("n4", prompt_len=10, n=4, max_tokens=6)
    scheduler.add(parent)
    plan = scheduler.schedule()
    for s in plan.scheduled:
        s.request.num_computed_tokens = s.end
    scheduler.register_computed_blocks(parent)
    children = [Request("n4", parent.prompt_token_ids, parent.sampling_params, index=i, group=parent.group,
                        arrival_order=parent.arrival_order, priority=parent.priority) for i in range(1, 4)]
    parent.group.choices.extend(children)
    scheduler.fork(parent, children)
    for choice in parent.group.choices:
        choice.output_token_ids.append(50_000)
    assert scheduler.num_running == 4 and all(c.arrival_step == parent.arrival_step for c in children)
    scheduler.add(request("urgent", priority=INTERACTIVE, first_token=2))
    plan = driver.step()
    assert plan.preempted == [children[-1]] and "urgent" in scheduled_ids(plan)
    driver.run(40)
    assert set(driver.finished) == {"n4/0", "n4/1", "n4/2", "n4/3", "urgent/0"}
    assert all(c.output_token_ids == [50_000 + i for i in range(6)] for c in parent.group.choices)
    assert scheduler.pool.num_free == scheduler.pool.num_blocks


def test_aging_steps_must_be_positive():
    with pytest.raises(ValueError, match="priority_aging_steps"):
        Scheduler(BlockPool(4, 4), max_num_seqs=1, max_num_batched_tokens=4, priority_aging_steps=0)
