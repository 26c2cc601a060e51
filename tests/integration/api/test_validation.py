"""Validation in the API: unknown model, context length, parameter ranges and types; error shape."""

from __future__ import annotations

import pytest
from api_support import auth, chat_body


@pytest.fixture
def key(make_key, tenant) -> str:
    return make_key(tenant)


def _post_job(client, key, body, endpoint="/v1/chat/completions"):
    return client.post("/v1/jobs", json={"endpoint": endpoint, "body": body}, headers=auth(key))


def _error(response, status):
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/chat/completions"])
def test_unknown_model_is_404_model_not_found(client, key, path):
    body = chat_body(model="nope")
    payload = {"endpoint": "/v1/chat/completions", "body": body} if path == "/v1/jobs" else body
    error = _error(client.post(path, json=payload, headers=auth(key)), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "nope" in error["message"]


def test_context_length_exceeded(client, key):
    error = _error(_post_job(client, key, chat_body(max_tokens=600)), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "maximum context length is 512 tokens" in error["message"]
    assert "600 in the completion" in error["message"]
    error = _error(_post_job(client, key, {"model": "tiny", "prompt": "word " * 600, "max_tokens": 4},
                             "/v1/completions"), 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 129}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"presence_penalty": -5}, "presence_penalty"),
])
def test_out_of_range_params_name_the_param(client, key, extra, param):
    for path, payload in [("/v1/jobs", {"endpoint": "/v1/chat/completions", "body": chat_body(**extra)}),
                          ("/v1/chat/completions", chat_body(**extra))]:
        error = _error(client.post(path, json=payload, headers=auth(key)), 400)
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"model": "tiny"}, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
])
def test_type_errors_are_400_naming_the_param(client, key, body, param):
    error = _error(client.post("/v1/chat/completions", json=body, headers=auth(key)), 400)
    assert error["param"] == param, error
    error = _error(_post_job(client, key, body), 400)
    assert error["param"] == param, error


def test_job_create_schema_errors(client, key):
    error = _error(client.post("/v1/jobs", json={"endpoint": "/v1/rerank", "body": {}}, headers=auth(key)), 400)
    assert error["param"] == "endpoint"
    error = _error(client.post("/v1/jobs", json={"endpoint": "/v1/completions"}, headers=auth(key)), 400)
    assert error["param"] == "body"
    response = client.post("/v1/jobs", content=b"{not json", headers=auth(key) | {"Content-Type": "application/json"})
    assert _error(response, 400)["type"] == "invalid_request_error"
    error = _error(client.get("/v1/jobs?limit=0", headers=auth(key)), 400)
    assert error["param"] == "limit"


def test_unknown_route_and_method_use_the_error_shape(client, key):
    error = _error(client.get("/v1/nothing", headers=auth(key)), 404)
    assert set(error) == {"message", "type", "param", "code"}
    assert _error(client.delete("/v1/models", headers=auth(key)), 405)["code"] == "method_not_allowed"


def _rule_chain(rules: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(rules)) + f'r{rules}: "a"\n'


def test_grammar_bomb_is_a_400_and_the_api_lives_on(client, key, monkeypatch):
    """A Lark chain of 3,500 rules crashed llguidance (and with it the API process): the rule
    cap refuses it; past the cap, the crash happens in a validator process and is a 400."""
    bomb = chat_body(guided_grammar=_rule_chain(3500))
    error = _error(client.post("/v1/chat/completions", json=bomb, headers=auth(key)), 400)
    assert error["param"] == "guided_grammar" and "rein takes at most 1000" in error["message"]

    from rein.engine.structured import limits
    monkeypatch.setattr(limits, "MAX_GRAMMAR_RULES", 10_000)
    error = _error(_post_job(client, key, bomb), 400)
    assert error["param"] == "guided_grammar" and "crashed rein's grammar compiler" in error["message"]
    assert client.get("/v1/models", headers=auth(key)).status_code == 200
    assert _post_job(client, key, chat_body(guided_regex="(yes|no)")).status_code == 202
