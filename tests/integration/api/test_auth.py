"""Keys and scopes: 401 for a missing, malformed, unknown or revoked key; 403 naming the scope."""

from __future__ import annotations

import time

import pytest
from api_support import auth, chat_body


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer "},
    {"Authorization": "Basic abc"},
    {"Authorization": "Bearer not-a-key"},
    {"Authorization": "Bearer rein_0123456789ab_" + "x" * 43},
])
def test_missing_or_bad_key_is_401(client, headers):
    for method, path in [("GET", "/v1/models"), ("GET", "/v1/jobs"), ("GET", "/v1/usage"),
                         ("GET", "/v1/jobs/job_x"), ("POST", "/v1/jobs/job_x/cancel"),
                         ("GET", "/v1/jobs/job_x/events")]:
        error = _error(client.request(method, path, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()},
                           headers=headers)
    assert _error(response, 401)["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_wrong_secret_and_revoked_key_are_401(client, make_key, tenant):
    key = make_key(tenant)
    wrong = key[:-1] + ("A" if key[-1] != "A" else "B")
    assert _error(client.get("/v1/models", headers=auth(wrong)), 401)["code"] == "invalid_api_key"
    revoked = make_key(tenant, revoked=True)
    error = _error(client.get("/v1/models", headers=auth(revoked)), 401)
    assert "revoked" in error["message"]


@pytest.mark.parametrize("bearer", ["x", "rein_0123456789ab_" + "x" * 43, "wrong", "revoked"])
def test_a_bad_key_is_refused_before_the_body_is_read(client, make_key, tenant, monkeypatch, bearer):
    """A 15 MB body of nested objects behind a made-up, wrong or revoked key: 401, and the body
    is never read, let alone parsed (it took 3.1 s and ~500 MB on the event loop before)."""
    from starlette.requests import Request

    if bearer == "wrong":
        key = make_key(tenant)
        bearer = key[:-1] + ("A" if key[-1] != "A" else "B")
    elif bearer == "revoked":
        bearer = make_key(tenant, revoked=True)
    reads = []
    real_body = Request.body

    async def counted_body(self):
        reads.append(self.url.path)
        return await real_body(self)

    monkeypatch.setattr(Request, "body", counted_body)
    depth = 5000
    payload = ('{"endpoint": "/v1/chat/completions", "body": ' + '{"a": ' * depth + "{}" + "}" * depth + "}")
    payload += " " * (15_000_000 - len(payload))
    for _attempt in range(2):   # the second one meets the remembered refusal
        response = client.post("/v1/jobs", content=payload.encode(),
                               headers={"Authorization": f"Bearer {bearer}", "Content-Type": "application/json"})
        assert _error(response, 401)["code"] == "invalid_api_key"
    assert reads == []
    good = make_key(tenant)
    client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()}, headers=auth(good))
    assert reads and set(reads) == {"/v1/jobs"}   # the spy sees the reads of a request that may make them


def test_a_key_revoked_while_in_use_is_refused_within_the_auth_cache_time(make_client, make_key,
                                                                          tenant, db_sessionmaker):
    from rein.store.keys import parse_key, revoke_key

    ttl = 0.5
    client = make_client(auth_cache_seconds=ttl)
    key = make_key(tenant)
    assert client.get("/v1/models", headers=auth(key)).status_code == 200   # now remembered
    with db_sessionmaker.begin() as session:
        revoke_key(session, parse_key(key)[0])
    revoked_at = time.monotonic()
    statuses = []
    while time.monotonic() - revoked_at < ttl + 0.5:
        statuses.append(client.get("/v1/models", headers=auth(key)).status_code)
    # Accepted at most until the remembered check expires, refused from then on.
    assert statuses[-1] == 401 and 401 in statuses
    assert statuses == sorted(statuses), statuses   # never 200 again after a 401

    uncached = make_client(auth_cache_seconds=0)
    key = make_key(tenant)
    assert uncached.get("/v1/models", headers=auth(key)).status_code == 200
    with db_sessionmaker.begin() as session:
        revoke_key(session, parse_key(key)[0])
    assert uncached.get("/v1/models", headers=auth(key)).status_code == 401


def test_scope_missing_is_403_naming_it(client, make_key, tenant):
    usage_only = make_key(tenant, "usage")
    for method, path, body in [
        ("POST", "/v1/jobs", {"endpoint": "/v1/chat/completions", "body": chat_body()}),
        ("POST", "/v1/chat/completions", chat_body()),
        ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi"}),
        ("GET", "/v1/jobs", None),
        ("GET", "/v1/jobs/job_x", None),
    ]:
        error = _error(client.request(method, path, json=body, headers=auth(usage_only)), 403)
        assert error["message"] == "API scope is not declared: inference"
    inference_only = make_key(tenant, "inference")
    error = _error(client.get("/v1/usage", headers=auth(inference_only)), 403)
    assert error["message"] == "API scope is not declared: usage"


def test_models_needs_any_valid_key(client, make_key, tenant):
    for scopes in ("usage", "inference", "batch"):
        response = client.get("/v1/models", headers=auth(make_key(tenant, scopes)))
        assert response.status_code == 200
        data = response.json()
        assert data["object"] == "list"
        assert [m["id"] for m in data["data"]] == ["tiny"]
        assert data["data"][0]["max_model_len"] == 512
