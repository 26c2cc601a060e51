"""A request's `priority` and `service_tier` (issue 45): the bands a job's priority is kept in
(rein.core.priorities), the fields' checks and mapping (rein.openai.priority), through request
preparation and batch validation with the tiny model's tokenizer, and through the engine: a
worse-priority batch line waiting beside a better one never runs first."""

from __future__ import annotations

import json

import pytest
from unit_support import prompt_of, record_plans

from rein.batches.validation import validate_lines
from rein.core.priorities import (
    LAST_QUEUE_STEP,
    MAX_PRIORITY_OFFSET,
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    job_priority,
    queue_step,
)
from rein.core.settings import Settings
from rein.jobs.prepare import prepare
from rein.jobs.registry import ModelRegistry
from rein.openai.errors import RequestError
from rein.openai.priority import RequestedPriority, parse_priority

# -- the bands -----------------------------------------------------------------------------------


def test_a_request_priority_moves_its_job_back_within_its_class_only():
    assert job_priority() == PRIORITY_INTERACTIVE == 0
    assert [job_priority(p) for p in (-5, 0, 1, 5, 6, 10**6)] == [0, 0, 1, 5, 5, 5]   # never the batch class
    assert job_priority(batch=True) == PRIORITY_BATCH
    assert [job_priority(p, batch=True) for p in (-3, 0, 2, 10**9)] == [6, 6, 8, 6 + MAX_PRIORITY_OFFSET]
    # The queue has ten steps: the batch class's worse priorities share the last one.
    assert [queue_step(p) for p in (0, 5, 6, 9, 10, 6 + MAX_PRIORITY_OFFSET)] == [0, 5, 6, 9, 9, LAST_QUEUE_STEP]


# -- the fields ----------------------------------------------------------------------------------


def test_service_tier_maps_to_a_class_and_priority_orders_within_it():
    assert parse_priority({}) == RequestedPriority(0, None)
    assert parse_priority({"priority": 3, "service_tier": "auto"}).job_priority() == 3
    assert parse_priority({"service_tier": "default"}).job_priority() == PRIORITY_INTERACTIVE
    assert parse_priority({"service_tier": "priority"}).job_priority() == PRIORITY_INTERACTIVE
    assert parse_priority({"service_tier": "flex", "priority": 2}).job_priority() == PRIORITY_BATCH + 2
    # A batch line is in the batch class whatever it says ("priority" is refused, below).
    assert parse_priority({"priority": -4}, batch_line=True).job_priority(batch_line=True) == PRIORITY_BATCH
    assert parse_priority({"service_tier": "default", "priority": 1}, batch_line=True).job_priority(True) == 7
    assert parse_priority({"priority": None, "service_tier": None}) == RequestedPriority(0, None)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"priority": "high"}, "priority", "must be an integer"),
    ({"priority": 1.5}, "priority", "must be an integer"),
    ({"priority": True}, "priority", "must be an integer"),
    ({"priority": 2**31}, "priority", "between"),
    ({"service_tier": "scale"}, "service_tier", "'auto', 'default', 'flex', 'priority'"),
    ({"service_tier": 1}, "service_tier", "must be one of"),
])
def test_bad_values_are_refused_naming_the_field(body, param, words):
    with pytest.raises(RequestError) as caught:
        parse_priority(body)
    assert caught.value.param == param and words in caught.value.message


def test_a_batch_line_cannot_ask_for_interactive_priority():
    with pytest.raises(RequestError) as caught:
        parse_priority({"service_tier": "priority"}, batch_line=True)
    assert caught.value.param == "service_tier" and "batch priority" in caught.value.message
    with pytest.raises(RequestError):   # nor lift a line parsed as a plain request
        RequestedPriority(0, "priority").job_priority(batch_line=True)


# -- through preparation and batch validation ----------------------------------------------------


@pytest.fixture(scope="module")
def registry(tiny_models) -> ModelRegistry:
    return ModelRegistry.load(Settings(models=f"tiny={tiny_models('llama')}@256"))


def chat_body(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def test_chat_completions_and_embeddings_take_priority(registry):
    assert prepare(registry, "/v1/chat/completions", chat_body(priority=2)).priority == 2
    assert prepare(registry, "/v1/chat/completions", chat_body(service_tier="flex")).priority == PRIORITY_BATCH
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "priority": 9, "service_tier": "priority"}
    assert prepare(registry, "/v1/completions", body).priority == PRIORITY_BATCH - 1
    assert prepare(registry, "/v1/embeddings", {"model": "tiny", "input": "hi", "priority": 1}).priority == 1
    with pytest.raises(RequestError) as caught:
        prepare(registry, "/v1/chat/completions", chat_body(service_tier="premium"))
    assert caught.value.param == "service_tier"


def line(custom_id: str, **fields) -> bytes:
    return (json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                        "body": chat_body(**fields)}) + "\n").encode()


def test_batch_lines_store_their_priority_in_the_batch_class(registry):
    handed = []
    result = validate_lines([line("a"), line("b", priority=3), line("c", priority=-1, service_tier="flex")],
                            "/v1/chat/completions", registry, 10, on_valid=handed.append)
    assert result.ok
    assert [v.job_values()["priority"] for v in handed] == [PRIORITY_BATCH, PRIORITY_BATCH + 3, PRIORITY_BATCH]


def test_a_batch_line_asking_for_the_priority_tier_is_a_line_error(registry):
    result = validate_lines([line("a"), line("b", service_tier="priority")], "/v1/chat/completions", registry, 10)
    assert not result.ok
    assert [(e["line"], e["param"]) for e in result.errors] == [(2, "body.service_tier")]


# -- through the engine ---------------------------------------------------------------------------


def test_a_worse_priority_line_never_overtakes_a_better_one_waiting_in_the_same_engine(tiny_models):
    """One sequence of capacity, a line running; a worse-priority line arrives, then a better one:
    both wait, and the better one is admitted first and finishes first, though it came later."""
    from rein.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_models("llama")), device="cpu", kv_cache_memory="8MiB",
                                    max_model_len=256, max_num_seqs=1))
    plans = record_plans(engine)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    worse, better = job_priority(5, batch=True), job_priority(1, batch=True)
    engine.add_request("running", prompt_of(20, seed=1), params, priority=job_priority(0, batch=True))
    engine.step()
    engine.add_request("worse", prompt_of(20, seed=2), params, priority=worse)
    engine.step()
    engine.add_request("better", prompt_of(20, seed=3), params, priority=better)
    finished: list[str] = []
    while engine.has_unfinished():
        finished += [out.request_id for out in engine.step() if out.finished]
    assert finished == ["running", "better", "worse"]
    first_step = {}
    for step, plan in enumerate(plans):
        for scheduled in plan.scheduled:
            first_step.setdefault(scheduled.request.request_id, step)
    assert first_step["better"] < first_step["worse"]
    # Nothing was preempted: the running line was better than both.
    assert sum(plan.priority_preemptions for plan in plans) == 0


def test_a_better_priority_line_preempts_the_worst_running_one(tiny_models):
    """Capacity full of lines of two priorities; a better line arriving preempts the worst-priority
    running line, not the newest."""
    from rein.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_models("llama")), device="cpu", kv_cache_memory="8MiB",
                                    max_model_len=256, max_num_seqs=2))
    plans = record_plans(engine)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine.add_request("worst", prompt_of(20, seed=1), params, priority=job_priority(4, batch=True))
    engine.step()
    engine.add_request("middle", prompt_of(20, seed=2), params, priority=job_priority(2, batch=True))
    engine.step()
    engine.add_request("best", prompt_of(20, seed=3), params, priority=job_priority(0, batch=True))
    engine.step()
    assert [r.request_id for r in plans[-1].preempted] == ["worst"]
    assert {s.request.request_id for s in plans[-1].scheduled} == {"middle", "best"}
    while engine.has_unfinished():
        engine.step()


def test_a_response_names_the_tier_that_ran_it_when_the_request_named_one():
    from datetime import UTC, datetime

    from rein.jobs.results import response_body
    from rein.store.tables import Job, Result

    def body(request: dict, priority: int) -> dict:
        job = Job(id="job_1", tenant="t", key_id="k", model="tiny", endpoint="/v1/chat/completions",
                  params={"body": request}, prompt_token_ids=[1, 2], prompt_tokens=2, priority=priority,
                  finished_at=datetime.now(UTC))
        result = Result(job_id="job_1", text="hi", finish_reason="stop", token_ids=[5], logprobs=None, response=None)
        return response_body(job, result)

    assert "service_tier" not in body({"messages": []}, PRIORITY_INTERACTIVE)    # not named: not echoed
    assert body({"service_tier": "auto"}, PRIORITY_INTERACTIVE)["service_tier"] == "default"
    assert body({"service_tier": "priority"}, 2)["service_tier"] == "default"
    assert body({"service_tier": "flex"}, job_priority(batch=True))["service_tier"] == "flex"


def test_run_batch_runs_the_better_priority_lines_first(tiny_models, tmp_path):
    """Offline, every line is in one class and `priority` orders those waiting in the engine (one
    sequence here, so they run one at a time): the output lists them as they finished."""
    from rein import LLM
    from rein.offline.run_batch import run_batch

    llm = LLM(tiny_models("llama"), kv_cache_memory="16MiB", max_num_seqs=1, max_model_len=128)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = {"first-in-file": {"priority": 3}, "urgent": {}, "middle": {"priority": 1},
             "refused": {"service_tier": "priority"}}
    src.write_text("".join(json.dumps({"custom_id": name, "method": "POST", "url": "/v1/completions",
                                       "body": {"prompt": "hello", "max_tokens": 3, "ignore_eos": True, **body}})
                           + "\n" for name, body in lines.items()))
    summary = run_batch(llm.engine, src, dst, progress=False, order="file", error_path=tmp_path / "err.jsonl")
    assert summary.requests_failed == 1
    done = [json.loads(x)["custom_id"] for x in dst.read_text().splitlines()]
    assert done == ["urgent", "middle", "first-in-file"]
    error = json.loads((tmp_path / "err.jsonl").read_text().splitlines()[0])
    assert error["custom_id"] == "refused" and "batch priority" in json.dumps(error)
