"""Scheduler.update (no model, no torch): after a step, the scheduler alone applies computed
tokens, prefix-cache registration, sampled tokens, stops with their finish and stop reasons,
forks, prompt logprobs and finished embedding requests; finished requests free their blocks."""

from __future__ import annotations

import pytest

from rein.engine.kv_cache_manager import KVCacheManager
from rein.engine.request import ChoiceGroup, Request, RequestStatus
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.engine.scheduler_output import ModelOutput

EOS = 7


def _scheduler(blocks: int = 32, caching: bool = False, max_model_len: int | None = None,
               windowed: bool = False) -> Scheduler:
    kv = KVCacheManager.create(blocks, 4, enable_caching=caching, num_windowed_blocks=16 if windowed else 0,
                               window=4 if windowed else None)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len)


def _request(rid: str, prompt_len: int = 6, n: int = 1, **params) -> Request:
    request = Request(rid, [100 + i for i in range(prompt_len)], SamplingParams(n=n, **params),
                      eos_token_ids=frozenset({EOS}))
    if n > 1:
        request.group = ChoiceGroup(n)
        request.group.choices.append(request)
    return request


def _prefill(scheduler: Scheduler, *requests: Request):
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    assert all(s.samples for s in plan.scheduled)
    return plan


def test_update_sets_computed_tokens_appends_and_registers():
    scheduler = _scheduler(caching=True)
    request = _request("a", prompt_len=9, max_tokens=5)
    plan = _prefill(scheduler, request)
    assert request.num_computed_tokens == 0   # schedule plans; update applies
    update = scheduler.update(plan, ModelOutput(sampled=[request], token_ids=[42]))
    assert request.num_computed_tokens == 9 and request.output_token_ids == [42]
    assert request.num_registered_blocks == 2 and scheduler.pool.num_cached == 2
    assert request.first_token_time is not None and request.status == RequestStatus.RUNNING
    assert update.ended == set()
    assert update.kv_utilization == pytest.approx(9 / 12) and update.kv_usage == 3 / 32


@pytest.mark.parametrize(("token", "params", "stop_string", "status", "stop_reason"), [
    (EOS, {}, None, RequestStatus.FINISHED_STOPPED, None),
    (9, {"stop_token_ids": [9]}, None, RequestStatus.FINISHED_STOPPED, 9),
    (5, {}, "lo", RequestStatus.FINISHED_STOPPED, "lo"),
    (5, {"max_tokens": 1}, None, RequestStatus.FINISHED_LENGTH, None),
    (5, {}, None, None, None),
])
def test_a_stop_ends_the_request_and_frees_its_blocks(token, params, stop_string, status, stop_reason):
    scheduler = _scheduler()
    request = _request("a", **params)
    plan = _prefill(scheduler, request)
    output = ModelOutput(sampled=[request], token_ids=[token], stop_strings={0: stop_string} if stop_string else {})
    update = scheduler.update(plan, output)
    if status is None:
        assert request.status == RequestStatus.RUNNING and update.ended == set()
        assert scheduler.pool.num_used == 2
        return
    assert request.status == status and request.stop_reason == stop_reason
    assert update.ended == {0} and not scheduler.has_unfinished()
    assert scheduler.pool.num_used == 0 and request.block_ids == []


def test_max_model_len_ends_with_length_and_a_complete_grammar_with_stop():
    scheduler = _scheduler(max_model_len=7)
    short, structured = _request("a"), _request("b")
    plan = _prefill(scheduler, short, structured)
    scheduler.update(plan, ModelOutput(sampled=[short, structured], token_ids=[5, 5], complete={1}))
    assert short.status == RequestStatus.FINISHED_LENGTH   # 6 prompt + 1 output = max_model_len
    assert structured.status == RequestStatus.FINISHED_STOPPED   # the grammar overrides length


def test_forks_start_the_choices_and_the_request_ends_with_its_last_choice():
    scheduler = _scheduler()
    parent = _request("p", prompt_len=6, n=3, max_tokens=3)
    plan = _prefill(scheduler, parent)
    children = [Request("p", parent.prompt_token_ids, parent.sampling_params, index=i, group=parent.group,
                        arrival_order=parent.arrival_order, eos_token_ids=parent.eos_token_ids) for i in (1, 2)]
    parent.group.choices.extend(children)
    choices = [parent, *children]
    update = scheduler.update(plan, ModelOutput(sampled=choices, token_ids=[5, EOS, 5], forks=[(parent, children)]))
    assert parent.group.forked and scheduler.num_running == 2
    assert children[1].block_ids[0] == parent.block_ids[0] and children[1].num_computed_tokens == 6
    assert scheduler.pool.ref_count(parent.block_ids[0]) == 2   # choice 1 stopped: its holds are gone
    assert children[0].status == RequestStatus.FINISHED_STOPPED and update.ended == set()
    assert parent.group.num_unfinished == 2
    # The partly filled block's copies go to the model runner with the next step.
    copies = scheduler.kv_cache.take_copies()
    assert [src for src, _ in copies.pairs] == [parent.block_ids[1]] * 2
    plan = scheduler.schedule()
    update = scheduler.update(plan, ModelOutput(sampled=[parent, children[1]], token_ids=[EOS, EOS]))
    assert update.ended == {1} and parent.group.num_unfinished == 0
    assert scheduler.pool.num_used == 0 and not scheduler.has_unfinished()


def test_prompt_logprobs_are_replaced_by_a_recompute_and_pooled_requests_end():
    scheduler = _scheduler()
    scoring, embedding = _request("a", max_tokens=4), _request("e")
    scoring.prompt_logprobs = [None, "old1", "old2"]
    plan = _prefill(scheduler, scoring, embedding)
    scheduler.update(plan, ModelOutput(sampled=[scoring], token_ids=[5], pooled=[embedding],
                                       prompt_logprobs=[(scoring, 1, ["new1", "new2", "new3"])]))
    assert scoring.prompt_logprobs == [None, "new1", "new2", "new3"]
    assert embedding.status == RequestStatus.FINISHED_STOPPED and embedding.block_ids == []
    assert scheduler.num_running == 1


def test_update_moves_the_windows_on():
    scheduler = _scheduler(windowed=True)
    request = _request("a", prompt_len=14, max_tokens=4)
    plan = _prefill(scheduler, request)
    assert request.window_end == 4   # covered when scheduled: every block the step writes
    scheduler.update(plan, ModelOutput(sampled=[request], token_ids=[5]))
    # The next query (position 14) reads keys 11..14: blocks 2 and 3 only.
    assert (request.window_first, request.window_end) == (2, 4)
    assert scheduler.windows.num_held == 2
