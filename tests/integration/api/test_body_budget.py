"""What a valid key can make the API spend on a body before it is refused: nothing for a key
without the route's scope (403 from the header, not a byte read), a bounded parse for one with
it (rein.core.json_budget), a bounded number of large bodies at once per key, and the same
checks behind a proxy's root path (REIN_API_ROOT_PATH)."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from api_support import auth, chat_body
from fastapi.testclient import TestClient

from rein.core.json_budget import MAX_JSON_CONTAINERS

FLOOD_BYTES = 15_000_000
EMPTY_LISTS = b"[" + b"[]," * (FLOOD_BYTES // 3 - 1) + b"[]]"   # what cost 399 MiB per 16 MiB parsed


class BodyBytesCounted:
    """An ASGI wrapper, outermost: counts the body bytes the app takes from the server."""

    def __init__(self, app) -> None:
        self.app = app
        self.read = 0

    async def __call__(self, scope, receive, send) -> None:
        async def counted():
            message = await receive()
            if message["type"] == "http.request":
                self.read += len(message.get("body", b""))
            return message

        await self.app(scope, counted if scope["type"] == "http" else receive, send)


@pytest.fixture
def counted_client(make_settings, model_dir, tmp_path):
    """(client, counter) of an app whose body reads are counted."""
    from rein.api.app import create_app

    def make(**overrides) -> tuple[TestClient, BodyBytesCounted]:
        counter = BodyBytesCounted(create_app(make_settings(models=f"tiny={model_dir}@512",
                                                            files_dir=str(tmp_path / "files"), **overrides)))
        client = TestClient(counter, root_path=overrides.get("api_root_path", ""))
        client.__enter__()
        clients.append(client)
        return client, counter

    clients: list[TestClient] = []
    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _job() -> dict:
    return {"endpoint": "/v1/chat/completions", "body": chat_body()}


def _post(client: TestClient, path: str, body: bytes, key: str):
    return client.post(path, content=body, headers=auth(key) | {"Content-Type": "application/json"})


def test_eight_big_bodies_from_a_key_without_the_scope_are_refused_unread(counted_client, make_key, tenant):
    """Eight 15 MB bodies at once from a key with only the `usage` scope: each gets its 403
    naming the scope, and the app takes not one byte of them (before, each was parsed first:
    1.7-3.1 GB of peak RSS for the eight)."""
    client, counter = counted_client()
    usage_only = make_key(tenant, "usage")
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda path: _post(client, path, EMPTY_LISTS, usage_only),
                                  ["/v1/chat/completions", "/v1/completions", "/v1/jobs", "/v1/embeddings"] * 2))
    for response in responses:
        assert response.status_code == 403, response.text[:300]
        assert response.json()["error"]["message"] == "API scope is not declared: inference"
    assert counter.read == 0
    batch_only = make_key(tenant, "batch")
    assert _post(client, "/v1/batches", EMPTY_LISTS, usage_only).status_code == 403
    upload = client.post("/v1/files", headers=auth(usage_only), data={"purpose": "batch"},
                         files={"file": ("in.jsonl", io.BytesIO(EMPTY_LISTS), "application/jsonl")})
    assert upload.status_code == 403 and "batch" in upload.json()["error"]["message"]
    assert counter.read == 0
    assert _post(client, "/v1/jobs", EMPTY_LISTS, batch_only).status_code == 403
    assert counter.read == 0


def test_a_scoped_key_s_big_body_is_refused_before_it_is_parsed(counted_client, make_key, tenant, monkeypatch):
    """With the scope the body is read, but its parse is refused from a count of what it would
    build: a 400 saying how many arrays and objects it holds and the limit, json.loads never
    called on it."""
    client, counter = counted_client(max_request_bytes=16 * 1024 * 1024)
    key = make_key(tenant)
    import rein.core.json_budget as budget

    parsed = []

    def loads(raw):
        parsed.append(len(raw))
        return json.loads(raw)

    monkeypatch.setattr(budget, "json", SimpleNamespace(loads=loads))
    response = _post(client, "/v1/chat/completions", EMPTY_LISTS, key)
    assert response.status_code == 400, response.text[:300]
    message = response.json()["error"]["message"]
    assert f"{MAX_JSON_CONTAINERS:,}" in message and "arrays and objects" in message
    assert counter.read == len(EMPTY_LISTS) and len(EMPTY_LISTS) not in parsed
    # A body within the caps is parsed and served as before.
    small = json.dumps(_job()).encode()
    response = _post(client, "/v1/jobs", small, key)
    assert response.status_code == 202, response.text
    assert len(small) in parsed


def test_json_nested_past_the_parser_s_limit_is_a_400(client, make_key, tenant):
    deep = '{"endpoint": "/v1/chat/completions", "body": ' + '[' * 5000 + ']' * 5000 + '}'
    response = client.post("/v1/jobs", content=deep.encode(),
                           headers=auth(make_key(tenant)) | {"Content-Type": "application/json"})
    assert response.status_code == 400, response.text[:300]
    assert "nested deeper" in response.json()["error"]["message"]


def test_a_key_s_large_bodies_at_once_are_capped(counted_client, make_key, tenant):
    """REIN_MAX_LARGE_BODIES_PER_KEY: with the key's slots all taken, its next body over 64 KiB
    gets 429 with Retry-After and is not read; a small body, or another key's, goes on."""
    client, counter = counted_client(max_large_bodies_per_key=2)
    key, other = make_key(tenant), make_key(tenant)
    key_id = key.split("_")[1]
    big = json.dumps(_job() | {"metadata": {"pad": "x" * 500}, "pad": " " * 100_000}).encode()
    assert len(big) > 64 * 1024                                 # over the slot threshold
    slots = client.app.app.state.large_body_slots
    assert slots.acquire(key_id) and slots.acquire(key_id)      # two bodies of this key in flight
    response = _post(client, "/v1/jobs", big, key)
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "too_many_large_requests"
    assert "REIN_MAX_LARGE_BODIES_PER_KEY" in response.json()["error"]["message"]
    assert response.headers["Retry-After"] == "1"
    assert counter.read == 0
    assert _post(client, "/v1/jobs", json.dumps(_job()).encode(), key).status_code == 202
    assert _post(client, "/v1/jobs", big, other).status_code == 400     # read, and refused for its fields
    slots.release(key_id)
    assert _post(client, "/v1/jobs", big, key).status_code == 400
    assert slots.held(key_id) == 1                               # the request gave its slot back


def test_behind_a_root_path_the_key_and_scope_still_come_first(counted_client, make_key, tenant):
    """REIN_API_ROOT_PATH=/rein: a request for /rein/v1/... is checked as /v1/... is (before,
    the prefix test missed it, and a body without a key was read and parsed)."""
    client, counter = counted_client(api_root_path="/rein", max_request_bytes=64 * 1024)
    response = client.post("/rein/v1/chat/completions", content=b'{"model": "tiny\\u0000"}',
                           headers={"Content-Type": "application/json"})
    assert response.status_code == 401, response.text
    response = _post(client, "/rein/v1/chat/completions", EMPTY_LISTS[:60_000], make_key(tenant, "usage"))
    assert response.status_code == 403, response.text
    assert counter.read == 0
    key = make_key(tenant, "inference,batch")
    assert client.get("/rein/v1/models", headers=auth(key)).status_code == 200
    # An upload is bounded by REIN_MAX_FILE_BYTES, not by the request limit, under the root path too.
    lines = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", "prompt": "p" * 100, "max_tokens": 2}}).encode() + b"\n"
                     for i in range(1000))
    assert len(lines) > 64 * 1024
    upload = client.post("/rein/v1/files", headers=auth(key), data={"purpose": "batch"},
                         files={"file": ("in.jsonl", io.BytesIO(lines), "application/jsonl")})
    assert upload.status_code == 200, upload.text
