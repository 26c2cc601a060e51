"""n > 1, echo, logit_bias and min_tokens through the API, with a fake worker playing the
engine's part: what a job stores for them, the body built from the stored choices (the
synchronous endpoint, GET /v1/jobs/{id}), the OpenAI chunks and job events per choice index,
the replay of several choices from Postgres, and the 400s."""

from __future__ import annotations

import json
import threading
import time

import pytest
from api_support import auth, chat_body
from sqlalchemy import select, update

from rein.store.messages import TokenEvent
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job, Result, Usage


@pytest.fixture
def key(make_key, tenant):
    return make_key(tenant)


def _datas(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# Two choices, interleaved as the publisher sends them: choice 1 ends first (stop), choice 0
# ends the job (length); usage sums both choices' tokens.
def _events(prompt_tokens: int) -> list[TokenEvent]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return [TokenEvent(1, "a", [10]), TokenEvent(2, "x", [20], index=1),
            TokenEvent(3, "b", [11]), TokenEvent(4, "y", [21], index=1, choice_finish_reason="stop"),
            TokenEvent(5, "c", [12], finish_reason="length", usage=usage, choice_finish_reason="length")]


def _stored_choices(chat: bool) -> list[dict]:
    def choice(index, text, finish):
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": finish}
        return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
    return [choice(0, "abc", "length"), choice(1, "xy", "stop")]


def _run_two_choices(fake_worker, job_id: str, chat: bool = True) -> None:
    """What the worker does for an n=2 job: events with indices, then the record with
    results.response (rein.worker.recorder)."""
    with fake_worker.sessions.begin() as session:
        job = session.get(Job, job_id)
        prompt_tokens = job.prompt_tokens
        fake_worker.publish(job_id, _events(prompt_tokens))
        session.execute(update(Job).where(Job.id == job_id).values(
            status="succeeded", started_at=job.queued_at, first_token_at=job.queued_at,
            finished_at=job.queued_at, attempt=1))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 5, "total_tokens": prompt_tokens + 5,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        session.add(Result(job_id=job_id, text="abc", finish_reason="length", token_ids=[10, 11, 12],
                           response={"choices": _stored_choices(chat), "usage": usage}))
        session.add(Usage(job_id=job_id, tenant=job.tenant, key_id=job.key_id, model=job.model,
                          prompt_tokens=prompt_tokens, completion_tokens=5))


def _serve_next(fake_worker, tenant: str, chat: bool = True) -> threading.Thread:
    def work() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with fake_worker.sessions() as session:
                job_id = session.scalar(select(Job.id).where(Job.tenant == tenant, Job.status == "queued"))
            if job_id:
                time.sleep(0.05)
                _run_two_choices(fake_worker, job_id, chat)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def test_a_job_stores_its_shape_and_a_plain_one_none(client, key, db_sessionmaker):
    several = client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/completions",
        "body": {"model": "tiny", "prompt": "Say", "max_tokens": 4, "n": 3, "echo": True,
                 "logit_bias": {"5": 10}, "min_tokens": 2}})
    plain = client.post("/v1/jobs", headers=auth(key), json={"endpoint": "/v1/chat/completions",
                                                             "body": chat_body()})
    assert several.status_code == plain.status_code == 202, several.text
    with db_sessionmaker() as session:
        job = session.get(Job, several.json()["id"])
        assert job.params["shape"] == {"n": 3, "echo": "Say"}
        sampling = job.params["sampling"]
        assert sampling["n"] == 3 and sampling["logit_bias"] == {"5": 10.0} and sampling["min_tokens"] == 2
        assert "shape" not in session.get(Job, plain.json()["id"]).params


def test_n_choices_answer_from_the_stored_result(client, key, fake_worker, tenant):
    thread = _serve_next(fake_worker, tenant)
    response = client.post("/v1/chat/completions", json=chat_body(n=2), headers=auth(key))
    thread.join(5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "abc", "length"), (1, "xy", "stop")]
    assert body["usage"]["completion_tokens"] == 5
    job_id = body["id"].removeprefix("chatcmpl-")
    job = client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()
    assert job["response"]["body"] == body and job["usage"]["completion_tokens"] == 5


def test_n_choices_stream_one_chunk_per_choice_event(client, key, fake_worker, tenant):
    thread = _serve_next(fake_worker, tenant)
    response = client.post("/v1/chat/completions", headers=auth(key),
                           json=chat_body(n=2, stream=True, stream_options={"include_usage": True}))
    thread.join(5)
    datas = _datas(response.text)
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks[:2])
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "abc", 1: "xy"} and finishes == {0: "length", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_job_events_carry_the_index(client, key, fake_worker):
    job_id = client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/chat/completions", "body": chat_body(n=2)}).json()["id"]
    _run_two_choices(fake_worker, job_id)
    events = [json.loads(d) for d in _datas(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)]
    assert [e.get("index", 0) for e in events] == [0, 1, 0, 1, 0]
    assert events[3]["choice_finish_reason"] == "stop" and events[-1]["finish_reason"] == "length"


def test_several_choices_replay_from_postgres(client, key, fake_worker, redis_client, settings):
    job_id = client.post("/v1/jobs", headers=auth(key), json={
        "endpoint": "/v1/completions",
        "body": {"model": "tiny", "prompt": "Say", "max_tokens": 4, "n": 2}}).json()["id"]
    _run_two_choices(fake_worker, job_id, chat=False)
    redis_client.delete(RedisKeys.from_settings(settings).job_stream(job_id))   # the stream expired
    events = [json.loads(d) for d in _datas(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)]
    assert [(e["index"], e["text"]) for e in events] == [(0, "abc"), (1, "xy")]
    assert events[-1]["finish_reason"] == "length" and events[-1]["replayed"]


@pytest.mark.parametrize("body, param", [
    ({"n": 129}, "n"),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"min_tokens": 9}, "min_tokens"),            # more than max_tokens (8)
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True}, "echo"),                     # a completions field
])
def test_bad_choice_fields_are_400_naming_them(client, key, body, param):
    response = client.post("/v1/chat/completions", headers=auth(key), json=chat_body(**body))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
