"""REIN_TOOL_CALL_PARSER through the API, with a fake worker writing the model's answer: the
parser is stored with the job, and the synchronous body, the stream and GET /v1/jobs/{id}
(rebuilt from Postgres) all read the calls in that format; a model served without the setting
reads its chat template's (the tiny model's teaches Hermes blocks)."""

from __future__ import annotations

import json

import pytest
from api_support import auth, chat_body

from rein.store.tables import Job

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LLAMA_ANSWER = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
PIECES = [(LLAMA_ANSWER[:17], [5, 6]), (LLAMA_ANSWER[17:40], [7]), (LLAMA_ANSWER[40:], [8])]


@pytest.fixture
def key(make_key, tenant):
    return make_key(tenant)


def _stored_parser(fake_worker, job_id: str) -> str | None:
    with fake_worker.sessions() as session:
        return session.get(Job, job_id).params.get("tool_parser")


def test_a_served_parser_reads_the_answer_everywhere(make_client, key, fake_worker, tenant):
    client = make_client(tool_call_parser="llama3_json")
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/chat/completions", json=chat_body("Weather?", tools=[WEATHER]), headers=auth(key))
    thread.join(5)
    assert response.status_code == 200, response.text
    body = response.json()
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    job_id = body["id"].removeprefix("chatcmpl-")
    assert _stored_parser(fake_worker, job_id) == "llama3_json"
    # rebuilt from Postgres: the same calls, the same ids
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()["response"]["body"] == body

    thread = fake_worker.serve_next(tenant, PIECES)
    streamed = client.post("/v1/chat/completions", json=chat_body("Weather?", tools=[WEATHER], stream=True),
                           headers=auth(key))
    thread.join(5)
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [part for d in deltas for part in d.get("tool_calls", [])]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_the_setting_the_template_chooses(client, key, fake_worker, tenant):
    thread = fake_worker.serve_next(tenant, PIECES)
    response = client.post("/v1/chat/completions", json=chat_body("Weather?", tools=[WEATHER]), headers=auth(key))
    thread.join(5)
    body = response.json()
    # the tiny model's template teaches Hermes blocks: a Llama-style answer is plain content
    assert body["choices"][0]["message"]["content"] == LLAMA_ANSWER
    assert "tool_calls" not in body["choices"][0]["message"]
    assert _stored_parser(fake_worker, body["id"].removeprefix("chatcmpl-")) == "hermes"


def test_a_request_without_tools_stores_no_parser(make_client, key, fake_worker, tenant):
    client = make_client(tool_call_parser="mistral")
    thread = fake_worker.serve_next(tenant, [("hi", [5])])
    response = client.post("/v1/chat/completions", json=chat_body("Hello"), headers=auth(key))
    thread.join(5)
    assert _stored_parser(fake_worker, response.json()["id"].removeprefix("chatcmpl-")) is None
