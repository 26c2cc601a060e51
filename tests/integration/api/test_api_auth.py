"""Keys and scopes: 401 for a missing, malformed, unknown or revoked key; 403 naming the scope."""

from __future__ import annotations

import pytest
from api_helpers import auth, chat_body


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
