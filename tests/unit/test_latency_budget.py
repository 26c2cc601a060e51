"""The interactive step budget (rein.engine.scheduler): while a request with interactive
priority is running or waiting, a step holds at most the budgeted batch-priority tokens; the
batch requests left out pause (running, blocks kept) and all run again once no interactive
request is left. On the scheduler alone (no model), then through the whole engine (tiny model):
greedy outputs are the same with the budget as without, and every request finishes."""

from __future__ import annotations

import pytest
from scheduler_support import BATCH, INTERACTIVE, Driver, request
from unit_support import make_engine, prompt_of, record_plans

from rein.core.settings import load_engine_settings
from rein.engine.block_pool import BlockPool
from rein.engine.request import RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler


def batch_tokens(plan) -> int:
    return sum(s.num_new_tokens for s in plan.scheduled if s.request.priority >= BATCH)


def has_interactive(plan) -> bool:
    return any(s.request.priority < BATCH for s in plan.scheduled)


def make_scheduler(budget: int | None, max_num_seqs: int = 8, blocks: int = 200,
                   max_num_batched_tokens: int = 256) -> Scheduler:
    return Scheduler(BlockPool(blocks, 4), max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     interactive_step_budget=budget)


def test_steps_with_interactive_work_hold_at_most_the_budgeted_batch_tokens():
    scheduler = make_scheduler(budget=2)
    driver = Driver(scheduler)
    batch = [request(f"b{i}", prompt_len=10, max_tokens=30, first_token=i + 1) for i in range(6)]
    for r in batch:
        scheduler.add(r)
    for _ in range(3):   # prefill and a few decodes with no interactive request: no limit
        plan = driver.step()
    assert batch_tokens(plan) == 6
    chat = request("chat", prompt_len=12, max_tokens=5, priority=INTERACTIVE, first_token=50)
    scheduler.add(chat)
    while "chat/0" not in driver.finished:
        plan = driver.step()
        assert has_interactive(plan)                       # it runs at every step it is in the engine
        assert batch_tokens(plan) <= 2
        # The batch requests left out are paused, not preempted: still running, blocks kept.
        assert all(r.status == RequestStatus.RUNNING and r.block_ids for r in batch)
    assert not any(p.preempted for p in driver.plans)
    plan = driver.step()                                   # the first step without it: every batch request
    assert batch_tokens(plan) == 6 and not has_interactive(plan)
    while scheduler.has_unfinished():
        driver.step()
    assert set(driver.finished) == {"chat/0", *(f"{r.request_id}/0" for r in batch)}
    assert scheduler.pool.num_used == 0


def test_the_budget_goes_to_the_best_ranked_batch_requests_and_chunks_their_prefill():
    scheduler = make_scheduler(budget=3)
    driver = Driver(scheduler)
    scheduler.add(request("chat", prompt_len=6, max_tokens=40, priority=INTERACTIVE, first_token=50))
    driver.step()
    first = request("b0", prompt_len=10, first_token=1)
    second = request("b1", prompt_len=10, first_token=2)
    scheduler.add(first)
    scheduler.add(second)
    plan = driver.step()   # b0 admitted with a 3-token chunk of its prompt; b1 waits
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("chat", 1), ("b0", 3)]
    assert second.status == RequestStatus.WAITING
    for _ in range(3):
        plan = driver.step()
        assert batch_tokens(plan) <= 3
    assert first.num_computed_tokens == 10 and first.num_output_tokens == 1   # prefilled in chunks of 3 (3+3+3+1)
    assert second.num_computed_tokens == 2        # b1 admitted with what b0's last chunk left (1 + 2)


def test_an_interactive_request_behind_an_aged_batch_request_is_still_admitted():
    scheduler = make_scheduler(budget=1, max_num_seqs=8)
    scheduler.priority_aging_steps = 1            # a batch request ages past interactive ones in 6 steps
    driver = Driver(scheduler)
    scheduler.add(request("chat0", prompt_len=6, max_tokens=100, priority=INTERACTIVE, first_token=50))
    old = [request(f"old{i}", prompt_len=8, first_token=i + 1) for i in range(3)]
    for r in old:
        scheduler.add(r)
    for _ in range(12):
        driver.step()
    # The old batch requests rank ahead of a new chat now; one batch token a step admits them slowly.
    late = request("chat1", prompt_len=6, max_tokens=3, priority=INTERACTIVE, first_token=60)
    scheduler.add(late)
    assert scheduler.rank(late) > min(scheduler.rank(r) for r in old if r.status == RequestStatus.WAITING)
    plan = driver.step()
    assert "chat1" in {s.request.request_id for s in plan.scheduled}
    assert batch_tokens(plan) <= 1
    assert scheduler.num_waiting == sum(r.status == RequestStatus.WAITING for r in old)   # the rest still queue


def test_off_by_default_and_without_interactive_work():
    assert Scheduler(BlockPool(10, 4), 4, 64).interactive_step_budget is None
    with pytest.raises(ValueError, match="interactive_step_budget"):
        make_scheduler(budget=-1)
    for budget in (None, 0):
        scheduler = make_scheduler(budget=budget)
        driver = Driver(scheduler)
        for i in range(4):
            scheduler.add(request(f"b{i}", prompt_len=5, max_tokens=4, first_token=i + 1))
        plan = driver.step()
        assert batch_tokens(plan) == 20               # batch work alone is never held back
        if budget == 0:
            scheduler.add(request("chat", prompt_len=5, max_tokens=2, priority=INTERACTIVE, first_token=50))
            plan = driver.step()
            assert [s.request.request_id for s in plan.scheduled] == ["chat"]   # 0: batch work pauses
        while scheduler.has_unfinished():
            driver.step()
        assert scheduler.pool.num_used == 0


def test_an_aborted_waiting_interactive_request_stops_holding_batch_work_back():
    scheduler = make_scheduler(budget=1, max_num_seqs=2)
    driver = Driver(scheduler)
    batch = [request(f"b{i}", prompt_len=5, max_tokens=30, first_token=i + 1) for i in range(2)]
    for r in batch:
        scheduler.add(r)
    driver.step()
    chat = request("chat", prompt_len=5, max_tokens=2, priority=INTERACTIVE, first_token=50)
    chat.arrival_step = 1_000                     # ranks behind both: it may not preempt them, so it waits
    scheduler.add(chat)
    assert batch_tokens(driver.step()) == 1       # held back while the chat waits
    scheduler.finish(chat, RequestStatus.FINISHED_ABORTED)
    assert batch_tokens(driver.step()) == 2


def test_the_setting_reaches_the_engine_config(monkeypatch):
    from rein.engine.config import CPU_INTERACTIVE_STEP_BUDGET, EngineConfig

    monkeypatch.setenv("REIN_INTERACTIVE_STEP_BUDGET", "12")
    assert load_engine_settings().interactive_step_budget == 12
    # auto (the default): on a CPU, where a step's time grows with its tokens; off on CUDA.
    assert EngineConfig(model="m", device="cpu").interactive_step_budget == CPU_INTERACTIVE_STEP_BUDGET == 4
    assert EngineConfig(model="m", device="cuda").interactive_step_budget is None
    assert EngineConfig(model="m", device="cpu", interactive_step_budget="off").interactive_step_budget is None
    assert EngineConfig(model="m", device="cpu", interactive_step_budget=0).interactive_step_budget == 0
    for bad in (-1, "4", 2.5, True):
        with pytest.raises(ValueError, match="interactive_step_budget"):
            EngineConfig(model="m", device="cpu", interactive_step_budget=bad)
    monkeypatch.setenv("REIN_INTERACTIVE_STEP_BUDGET", "off")
    assert load_engine_settings().interactive_step_budget == "off"


# -- through the engine --------------------------------------------------------------------------


def budget_engine(model_dir, budget: int | None):
    engine = make_engine(model_dir, max_num_seqs=6, interactive_step_budget=budget)
    assert engine.scheduler.interactive_step_budget == budget
    return engine


def run(engine, arrivals: dict[int, list[tuple]]):
    plans = record_plans(engine)
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for request_id, prompt, params, priority in arrivals.get(step, []):
            engine.add_request(request_id, prompt, params, priority=priority)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    return tokens, plans


def test_greedy_outputs_are_the_same_with_the_budget_and_every_request_finishes(tiny_models):
    model_dir = tiny_models("llama")
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    arrivals = {0: [(f"batch{i}", prompt_of(20 + 7 * i, seed=i), greedy, BATCH) for i in range(5)]}
    for k, step in enumerate((3, 9, 10, 30)):
        arrivals.setdefault(step, []).append(
            (f"chat{k}", prompt_of(12, seed=100 + k), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
             INTERACTIVE))
    expected, _ = run(budget_engine(model_dir, None), arrivals)
    engine = budget_engine(model_dir, 2)
    got, plans = run(engine, arrivals)
    assert got == expected and len(got) == 9 and all(len(v) == (24 if k.startswith("batch") else 6)
                                                      for k, v in got.items())
    held = [p for p in plans if has_interactive(p)]
    assert held and all(batch_tokens(p) <= 2 for p in held)
    assert any(batch_tokens(p) > 2 for p in plans if not has_interactive(p))   # the rest ran in full
    assert engine.pool.num_used == 0 and not engine.has_unfinished()


def test_batch_prefill_stays_held_for_the_hold_steps_after_the_last_chat():
    """Interactive requests come in runs: for INTERACTIVE_HOLD_STEPS after the last one left, a
    batch prefill is still chunked, to HOLD_PREFILL_FACTOR x the budget (so the next chat
    meets a short step), while the batch's decodes all run again at once."""
    from rein.engine.scheduler import HOLD_PREFILL_FACTOR, INTERACTIVE_HOLD_STEPS

    held = 2 * HOLD_PREFILL_FACTOR
    scheduler = make_scheduler(budget=2, blocks=400)
    driver = Driver(scheduler)
    batch = [request(f"b{i}", prompt_len=8, max_tokens=400, first_token=i + 1) for i in range(3)]
    for r in batch:
        scheduler.add(r)
    driver.step()
    scheduler.add(request("chat", prompt_len=6, max_tokens=2, priority=INTERACTIVE, first_token=50))
    while "chat/0" not in driver.finished:
        driver.step()
    late = request("late", prompt_len=3 * held, max_tokens=2, first_token=90)
    scheduler.add(late)
    plan = driver.step()
    assert not has_interactive(plan)
    decodes = [s for s in plan.scheduled if s.request in batch]
    assert len(decodes) == 3 and all(s.num_new_tokens == 1 for s in decodes)        # decodes: not held
    assert [s.num_new_tokens for s in plan.scheduled if s.request is late] == [held]   # its prefill: held
    while late.num_computed_tokens < late.num_prompt_tokens:
        plan = driver.step()
        assert all(s.num_new_tokens <= held for s in plan.scheduled if s.request is late)
    # Past the hold, a batch prefill takes the whole step again.
    while scheduler.num_steps - scheduler._interactive_step <= INTERACTIVE_HOLD_STEPS:
        driver.step()
    fresh = request("fresh", prompt_len=3 * held, max_tokens=2, first_token=95)
    scheduler.add(fresh)
    plan = driver.step()
    assert [s.num_new_tokens for s in plan.scheduled if s.request is fresh] == [3 * held]


def test_with_a_budget_batch_prefill_stays_within_its_cap_before_any_chat():
    """The first chat of a run meets at most BATCH_PREFILL_STEP_TOKENS of batch prefill in the step
    in flight, not a whole max_num_batched_tokens step; interactive prefill and batch decodes are
    not held, and without a budget nothing is."""
    from rein.engine.scheduler import BATCH_PREFILL_STEP_TOKENS

    cap = BATCH_PREFILL_STEP_TOKENS
    for budget, expected in ((4, [cap, cap, 100]), (None, [612])):
        scheduler = make_scheduler(budget=budget, blocks=400, max_num_batched_tokens=1024)
        driver = Driver(scheduler)
        long = request("long", prompt_len=612, max_tokens=2, first_token=1)
        scheduler.add(long)
        chunks = []
        while long.num_computed_tokens < long.num_prompt_tokens:
            chunks += [s.num_new_tokens for s in driver.step().scheduled if s.request is long]
        assert chunks == expected
    # An interactive prompt is not held by it.
    scheduler = make_scheduler(budget=4, blocks=400, max_num_batched_tokens=1024)
    scheduler.add(request("chat", prompt_len=612, max_tokens=2, priority=INTERACTIVE, first_token=2))
    assert [s.num_new_tokens for s in Driver(scheduler).step().scheduled] == [612]
