"""GET /v1/usage aggregates; /healthz, /readyz; the OpenAPI schema; refusing an unmigrated DB."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from api_support import auth
from fastapi.testclient import TestClient
from sqlalchemy import update

from rein.store.db import DatabaseNotMigratedError
from rein.store.tables import Job, Usage


def _job_with_usage(session, tenant, key_id, model, prompt, completion, when):
    job = Job(tenant=tenant, key_id=key_id, model=model, endpoint="/v1/completions", params={},
              prompt_token_ids=[1] * prompt, prompt_tokens=prompt, status="succeeded")
    session.add(job)
    session.flush()
    session.add(Usage(job_id=job.id, tenant=tenant, key_id=key_id, model=model, prompt_tokens=prompt,
                      completion_tokens=completion, created_at=when))


def test_usage_by_model_and_day(client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant)
    other = make_key(f"o-{tenant}")
    key_id = key.split("_")[1]
    today = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    yesterday = today - timedelta(days=1)
    with db_sessionmaker.begin() as session:
        _job_with_usage(session, tenant, key_id, "tiny", 10, 5, today)
        _job_with_usage(session, tenant, key_id, "tiny", 20, 7, today)
        _job_with_usage(session, tenant, key_id, "big", 3, 1, today)
        _job_with_usage(session, tenant, key_id, "tiny", 1, 1, yesterday)
        _job_with_usage(session, f"o-{tenant}", other.split("_")[1], "tiny", 99, 99, today)
    report = client.get("/v1/usage", headers=auth(key)).json()
    assert report["tenant"] == tenant
    rows = {(r["date"], r["model"]): r for r in report["data"]}
    day, prev = today.date().isoformat(), yesterday.date().isoformat()
    assert set(rows) == {(day, "tiny"), (day, "big"), (prev, "tiny")}
    assert rows[(day, "tiny")] | {} == {"date": day, "model": "tiny", "requests": 2, "prompt_tokens": 30,
                                        "completion_tokens": 12, "cached_tokens": 0, "total_tokens": 42}
    only_today = client.get(f"/v1/usage?start={day}", headers=auth(key)).json()["data"]
    assert {r["date"] for r in only_today} == {day}
    bad = client.get("/v1/usage?start=yesterday", headers=auth(key))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"


def test_health_and_ready(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["status"] == "ready"
    assert set(ready.json()["checks"]) == {"redis", "postgres"}


def test_ready_is_503_when_redis_is_gone(make_client):
    client = make_client()
    client.app.state.redis = __import__("redis").Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    response = client.get("/readyz")
    assert response.status_code == 503 and response.json()["checks"]["redis"] == "unavailable"
    assert "127.0.0.1" not in response.text and ":1" not in response.text     # nothing about where it is


def test_openapi_lists_the_routes(client):
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    expected = {"/v1/chat/completions": {"post"}, "/v1/completions": {"post"}, "/v1/models": {"get"},
                "/v1/jobs": {"get", "post"}, "/v1/jobs/{job_id}": {"get"},
                "/v1/jobs/{job_id}/cancel": {"post"}, "/v1/jobs/{job_id}/events": {"get"},
                "/v1/usage": {"get"}, "/healthz": {"get"}, "/readyz": {"get"},
                "/v1/files": {"get", "post"}, "/v1/files/{file_id}": {"get", "delete"},
                "/v1/files/{file_id}/content": {"get"}, "/v1/batches": {"get", "post"},
                "/v1/batches/{batch_id}": {"get"}, "/v1/batches/{batch_id}/cancel": {"post"}}
    for path, methods in expected.items():
        assert methods <= set(paths[path]), path
    assert paths["/v1/jobs"]["post"]["responses"]["202"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobCreated"}
    assert {"400", "401", "403", "409", "429", "503"} <= set(paths["/v1/jobs"]["post"]["responses"])
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    # Validation errors are answered 400 in OpenAI's shape, and documented so.
    for path in paths.values():
        for operation in path.values():
            assert "422" not in operation["responses"]


def test_refuses_an_unmigrated_database(make_database, make_settings, model_dir):
    from rein.api.app import create_app

    settings = make_settings(database_url=make_database(), models=f"tiny={model_dir}@512")
    with pytest.raises(DatabaseNotMigratedError, match="rein migrate"):
        with TestClient(create_app(settings)):
            pass


def test_max_model_len_from_config_when_not_given(make_client, make_key, tenant, model_dir):
    import json
    from pathlib import Path

    expected = json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"]
    client = make_client(models=f"tiny={model_dir}")
    data = client.get("/v1/models", headers=auth(make_key(tenant, "usage"))).json()["data"]
    assert data[0]["max_model_len"] == expected


def test_cancel_running_job_sets_flag_only(client, make_key, tenant, db_sessionmaker, redis_client, settings):
    key = make_key(tenant)
    job_id = client.post("/v1/jobs", json={"endpoint": "/v1/completions",
                                           "body": {"model": "tiny", "prompt": "x"}},
                         headers=auth(key)).json()["id"]
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status="running", attempt=1))
    pubsub = redis_client.pubsub()
    from rein.store.redis_keys import RedisKeys

    keys = RedisKeys.from_settings(settings)
    pubsub.subscribe(keys.cancel_channel())
    pubsub.get_message(timeout=1)
    job = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key)).json()
    assert job["status"] == "running" and job["cancel_requested_at"] is not None
    message = pubsub.get_message(timeout=2)
    assert message and message["data"].decode() == job_id
    pubsub.close()
