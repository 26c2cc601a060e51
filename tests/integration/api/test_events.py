"""SSE: job events with ids, Last-Event-ID resume, replay from Postgres; OpenAI streaming and waits."""

from __future__ import annotations

import json
import time

import pytest
from api_support import auth, chat_body

from rein.store.messages import TokenEvent
from rein.store.redis_keys import RedisKeys


def _events(text: str) -> list[tuple[int | None, str]]:
    out, event_id = [], None
    for line in text.splitlines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
            event_id = None
    return out


@pytest.fixture
def key(make_key, tenant):
    return make_key(tenant)


def _job(client, key):
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()},
                           headers=auth(key))
    assert response.status_code == 202
    return response.json()["id"]


PIECES = [("Hel", [10]), ("lo", [11]), (" wor", [12, 13]), ("ld", [14])]


def test_events_stream_and_resume_without_gap_or_repeat(client, key, fake_worker):
    job_id = _job(client, key)
    fake_worker.run(job_id, PIECES)
    events = _events(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)
    assert [e for e, _ in events] == [1, 2, 3, 4]
    data = [json.loads(d) for _, d in events]
    assert "".join(d["text"] for d in data) == "Hello world"
    assert [t for d in data for t in d["token_ids"]] == [10, 11, 12, 13, 14]
    assert data[-1]["finish_reason"] == "stop" and data[-1]["usage"]["completion_tokens"] == 5

    for last in (1, 2, 3):
        resumed = _events(client.get(f"/v1/jobs/{job_id}/events",
                                     headers=auth(key) | {"Last-Event-ID": str(last)}).text)
        assert [e for e, _ in resumed] == list(range(last + 1, 5))
        assert [json.loads(d)["text"] for _, d in resumed] == [p for p, _ in PIECES[last:]]
    bad = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key) | {"Last-Event-ID": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "Last-Event-ID"


def test_replay_from_postgres_after_the_stream_expired(client, key, fake_worker, redis_client, settings):
    job_id = _job(client, key)
    fake_worker.run(job_id, PIECES)
    redis_client.delete(RedisKeys.from_settings(settings).job_stream(job_id))
    events = _events(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)
    assert len(events) == 1
    event_id, raw = events[0]
    data = json.loads(raw)
    assert event_id == 1 and data["replayed"] is True
    assert data["text"] == "Hello world" and data["token_ids"] == [10, 11, 12, 13, 14]
    assert data["finish_reason"] == "stop" and data["usage"]["completion_tokens"] == 5


def test_resuming_from_a_trimmed_event_is_an_error_not_a_gap(client, key, fake_worker, redis_client,
                                                             settings):
    job_id = _job(client, key)
    fake_worker.run(job_id, PIECES)
    stream = RedisKeys.from_settings(settings).job_stream(job_id)
    redis_client.xtrim(stream, maxlen=2, approximate=False)   # what the cap does to a long job: events 1 and 2 gone
    resumed = _events(client.get(f"/v1/jobs/{job_id}/events",
                                 headers=auth(key) | {"Last-Event-ID": "2"}).text)
    assert [e for e, _ in resumed] == [3, 4]   # nothing missing after 2: served as usual
    events = _events(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)
    assert len(events) == 1
    data = json.loads(events[0][1])
    assert data["code"] == "events_expired" and "events 1 to 2" in data["error"]
    resumed = _events(client.get(f"/v1/jobs/{job_id}/events",
                                 headers=auth(key) | {"Last-Event-ID": "1"}).text)
    assert json.loads(resumed[0][1])["code"] == "events_expired" and "event 2 " in resumed[0][1]


def test_events_follow_a_job_as_it_runs(client, key, fake_worker, tenant):
    thread = fake_worker.serve_next(tenant, PIECES)
    job_id = _job(client, key)
    events = _events(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)
    thread.join(5)
    assert [e for e, _ in events] == [1, 2, 3, 4]


def test_job_view_when_done(client, key, fake_worker):
    job_id = _job(client, key)
    fake_worker.run(job_id, PIECES)
    job = client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()
    assert job["status"] == "succeeded"
    assert job["usage"]["completion_tokens"] == 5
    assert job["response"]["status_code"] == 200
    body = job["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == "Hello world"
    assert job["timings"]["queue_seconds"] is not None
    assert job["timings"]["time_to_first_token_seconds"] is not None


def test_chat_completion_waits_for_the_stored_result(client, key, fake_worker, tenant):
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/chat/completions", json=chat_body(), headers=auth(key))
    thread.join(5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-job_")
    assert body["choices"][0]["message"]["content"] == "Hello world"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 5
    job_id = body["id"].removeprefix("chatcmpl-")
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()["response"]["body"] == body


def test_chat_completion_streams_openai_chunks_with_usage(client, key, fake_worker, tenant):
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/chat/completions", headers=auth(key),
                           json=chat_body(stream=True, stream_options={"include_usage": True}))
    thread.join(5)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    datas = [d for _, d in _events(response.text)]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_completion_stream_without_usage(client, key, fake_worker, tenant):
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/completions", headers=auth(key),
                           json={"model": "tiny", "prompt": "Say", "max_tokens": 5, "stream": True})
    thread.join(5)
    datas = [d for _, d in _events(response.text)]
    assert datas[-1] == "[DONE]"
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"


def test_failed_event_ends_the_stream(client, key, fake_worker):
    job_id = _job(client, key)
    fake_worker.publish(job_id, [TokenEvent(seq=1, text="a", token_ids=[1]),
                                 TokenEvent(seq=2, text="", error="the engine failed")])
    events = _events(client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text)
    assert [e for e, _ in events] == [1, 2]
    assert json.loads(events[-1][1])["error"] == "the engine failed"


def test_resuming_at_or_past_the_final_event_ends_at_once(client, key, fake_worker):
    job_id = _job(client, key)
    fake_worker.run(job_id, PIECES)
    for last in ("4", "9"):                    # the final event is 4
        started = time.monotonic()
        text = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key) | {"Last-Event-ID": last}).text
        assert _events(text) == [] and time.monotonic() - started < 10   # not an idle wait (15 s)
