"""REIN_MAX_STREAMS_PER_KEY: a key holding that many event streams open gets 429
`too_many_streams` for one more (GET /v1/jobs/{id}/events or `stream: true`), other keys
still stream, and a slot comes back when its stream ends, however it ends."""

from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
from api_support import auth, chat_body

from rein.api.routes.jobs import SlotStreamingResponse, take_stream_slot
from rein.api.streams import StreamSlots
from rein.store.keys import parse_key

PIECES = [("Hel", [10]), ("lo", [11]), (" wor", [12, 13]), ("ld", [14])]


def _job(client, key: str) -> str:
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()},
                           headers=auth(key))
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _held(client, key: str) -> int:
    return client.app.state.stream_slots.held(parse_key(key)[0])


def _text(lines) -> str:
    """The concatenated `text` of rein's SSE events, read to the final one."""
    text = ""
    for line in lines:
        if line.startswith("data: "):
            data = json.loads(line[6:])
            text += data["text"]
            if data.get("finish_reason") or data.get("error"):
                break
    return text


def _job_count(client, key: str) -> int:
    return len(client.get("/v1/jobs", params={"limit": 100}, headers=auth(key)).json()["data"])


def test_a_key_past_its_stream_limit_gets_429_while_another_key_streams(make_client, make_key, tenant,
                                                                          fake_worker):
    client = make_client(max_streams_per_key=2)
    key_a, key_b = make_key(tenant), make_key(f"{tenant}-b")
    job_a, job_b = _job(client, key_a), _job(client, key_b)
    with ExitStack() as stack:
        streams = [stack.enter_context(client.stream("GET", f"/v1/jobs/{job_a}/events", headers=auth(key_a)))
                   for _ in range(2)]
        assert [s.status_code for s in streams] == [200, 200]
        assert _held(client, key_a) == 2

        refused = client.get(f"/v1/jobs/{job_a}/events", headers=auth(key_a))
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "2"
        error = refused.json()["error"]
        assert error["code"] == "too_many_streams" and error["type"] == "requests"
        assert "2 event streams" in error["message"] and "REIN_MAX_STREAMS_PER_KEY" in error["message"]

        # A streamed completion is refused before its job is accepted: nothing queued for it.
        jobs_before = _job_count(client, key_a)
        refused = client.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(key_a))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_streams"
        assert _job_count(client, key_a) == jobs_before

        # Another key is not held back by key A's streams.
        other = stack.enter_context(client.stream("GET", f"/v1/jobs/{job_b}/events", headers=auth(key_b)))
        assert other.status_code == 200
        fake_worker.run(job_a, PIECES)
        fake_worker.run(job_b, PIECES)
        assert _text(other.iter_lines()) == "Hello world"
        assert [_text(s.iter_lines()) for s in streams] == ["Hello world", "Hello world"]
    assert _held(client, key_a) == 0 and _held(client, key_b) == 0
    again = client.get(f"/v1/jobs/{job_a}/events", headers=auth(key_a))
    assert again.status_code == 200 and _text(again.text.splitlines()) == "Hello world"


def test_a_slot_comes_back_when_the_stream_ends(make_client, make_key, tenant, fake_worker):
    client = make_client(max_streams_per_key=1)
    key = make_key(tenant)
    job_id = _job(client, key)
    # The client leaves before any event: the response is cancelled, its slot given back.
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=auth(key)) as response:
        assert response.status_code == 200 and _held(client, key) == 1
    assert _held(client, key) == 0

    # A stream read to its end.
    fake_worker.run(job_id, PIECES)
    for _ in range(2):
        response = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key))
        assert response.status_code == 200 and _text(response.text.splitlines()) == "Hello world"
        assert _held(client, key) == 0

    # A streamed completion, to [DONE].
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/chat/completions", json=chat_body(stream=True), headers=auth(key))
    thread.join(5)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    assert _held(client, key) == 0

    # A streamed completion its intake refuses (prompt + max_tokens past the 512-token context).
    for _ in range(2):
        refused = client.post("/v1/chat/completions", json=chat_body(stream=True, max_tokens=5000),
                              headers=auth(key))
        assert refused.status_code == 400, refused.text
        assert _held(client, key) == 0


async def _chunks(fail: bool = False):
    yield "data: 1\n\n"
    if fail:
        raise RuntimeError("the follower failed")
    yield "data: 2\n\n"


async def _receive() -> dict:
    await asyncio.sleep(3600)
    return {"type": "http.disconnect"}


SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}}


@pytest.mark.parametrize("case", ["complete", "error", "send_fails_at_start", "send_fails_mid_body"])
def test_the_slot_is_released_however_the_response_ends(case):
    slots = StreamSlots(per_key=3)
    slots.acquire("k")    # another stream of the key, still open
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(stream_slots=slots)))
    release = take_stream_slot(request, SimpleNamespace(key_id="k"))
    assert slots.held("k") == 2
    sent: list[dict] = []

    async def send(message: dict) -> None:
        if case == "send_fails_at_start" or (case == "send_fails_mid_body" and sent):
            raise OSError("the client is gone")
        sent.append(message)

    async def run() -> None:
        response = SlotStreamingResponse(_chunks(fail=case == "error"), release,
                                         media_type="text/event-stream")
        await response(SCOPE, _receive, send)

    if case == "complete":
        asyncio.run(run())
        assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    else:
        with pytest.raises(Exception):  # noqa: B017  (the error itself is Starlette's business)
            asyncio.run(run())
    assert slots.held("k") == 1   # released once, though both the body and the response give it back
