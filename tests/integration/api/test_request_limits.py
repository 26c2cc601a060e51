"""What a request may cost: the body size limit (413 before parsing, chunked bodies counted as
they arrive), no body read without a key (401), and the caps on what a request may hold,
each refused with a 400 naming the parameter."""

from __future__ import annotations

import json

import pytest
from api_support import auth, chat_body

LIMIT = 64 * 1024


@pytest.fixture
def limited(make_client):
    return make_client(max_request_bytes=LIMIT)


def test_a_body_over_the_limit_is_refused_before_it_is_read(limited, make_key, tenant):
    key = make_key(tenant)
    big = json.dumps(chat_body("x" * (2 * LIMIT))).encode()
    response = limited.post("/v1/chat/completions", content=big,
                            headers=auth(key) | {"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "REIN_MAX_REQUEST_BYTES" in error["message"]


def test_a_chunked_body_is_counted_as_it_arrives(limited, make_key, tenant):
    key = make_key(tenant)

    def chunks():                     # no Content-Length: the server must count
        for _ in range(64):
            yield b"x" * 8192

    response = limited.post("/v1/jobs", content=chunks(),
                            headers=auth(key) | {"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"


def test_without_a_key_nothing_is_read(client):
    # Invalid JSON without a key: 401 (the key is checked first), not 400.
    response = client.post("/v1/chat/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert client.get("/healthz").status_code == 200        # the open routes stay open


@pytest.mark.parametrize(("change", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 10_000}]}, "messages"),   # 512 x 64 characters
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": "x" * 257}, "stop"),
    ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
])
def test_caps_on_what_a_request_holds(client, make_key, tenant, change, param):
    response = client.post("/v1/chat/completions", json=chat_body() | change, headers=auth(make_key(tenant)))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_long_completion_prompt_is_refused_before_tokenizing(client, make_key, tenant):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "a" * (512 * 64 + 1)},
                           headers=auth(make_key(tenant)))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_job_metadata_has_the_limits_of_batch_metadata(client, make_key, tenant):
    key = make_key(tenant)
    for metadata in ({"k" * 65: "v"}, {"k": "v" * 513}, {f"k{i}": "v" for i in range(17)}):
        response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body(),
                                                 "metadata": metadata}, headers=auth(key))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "metadata"
