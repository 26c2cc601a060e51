"""POST/GET /v1/jobs, cancel, idempotency, backpressure, tenant isolation on every {id} route."""

from __future__ import annotations

import json
import secrets

from api_support import auth, chat_body
from sqlalchemy import func, select, update
from transformers import AutoTokenizer

from rein.jobs.queues import queue_keys
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job


def _create(client, key, body=None, headers=None, endpoint="/v1/chat/completions"):
    response = client.post("/v1/jobs", json={"endpoint": endpoint, "body": body or chat_body(),
                                             "metadata": {"k": "v"}},
                           headers=auth(key) | (headers or {}))
    assert response.status_code == 202, response.text
    return response.json()


def _queue_messages(redis_client, settings, model):
    return [m for q in queue_keys(settings, model) for m in redis_client.lrange(q, 0, -1)]


def test_job_is_stored_with_token_ids_and_queued_once(make_client, make_key, tenant, db_session,
                                                      redis_client, model_dir):
    model = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{model}={model_dir}@512")
    key = make_key(tenant)
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 5}
    created = _create(client, key, body, endpoint="/v1/completions")
    assert created["status"] == "queued" and created["id"].startswith("job_")

    job = db_session.get(Job, created["id"])
    expected = AutoTokenizer.from_pretrained(model_dir).encode("The quick brown fox")
    assert job.prompt_token_ids == expected and job.prompt_tokens == len(expected)
    assert job.tenant == tenant and job.model == model and job.status == "queued"
    assert job.params["sampling"]["max_tokens"] == 5
    assert job.metadata_ == {"k": "v"}

    settings = client.app.state.settings
    messages = _queue_messages(redis_client, settings, model)
    assert len(messages) == 1
    payload = json.loads(messages[0])
    task_args = json.loads(__import__("base64").b64decode(payload["body"]))[0][0]
    assert task_args["job_id"] == created["id"]
    assert task_args["prompt_token_ids"] == expected
    assert "prompt" not in task_args   # the worker gets token ids, never text


def test_get_job_and_list_newest_first_with_cursor(client, make_key, tenant):
    key = make_key(tenant)
    ids = [_create(client, key)["id"] for _ in range(3)]
    job = client.get(f"/v1/jobs/{ids[0]}", headers=auth(key)).json()
    assert job["id"] == ids[0] and job["status"] == "queued" and job["object"] == "job"
    assert job["usage"] is None and job["response"] is None
    assert job["timings"]["queued_at"] and job["timings"]["queue_seconds"] is None

    page = client.get("/v1/jobs?limit=2", headers=auth(key)).json()
    assert [j["id"] for j in page["data"]] == [ids[2], ids[1]]
    assert page["has_more"] is True and page["last_id"] == ids[1]
    page = client.get(f"/v1/jobs?limit=2&after={ids[1]}", headers=auth(key)).json()
    assert [j["id"] for j in page["data"]] == [ids[0]]
    assert page["has_more"] is False

    # Filters: by status (with the cursor), and a bad status names the parameter.
    assert client.post(f"/v1/jobs/{ids[1]}/cancel", headers=auth(key)).json()["status"] == "cancelled"
    queued = client.get("/v1/jobs?status=queued", headers=auth(key)).json()
    assert [j["id"] for j in queued["data"]] == [ids[2], ids[0]]
    assert [j["id"] for j in client.get(f"/v1/jobs?status=queued&after={ids[2]}", headers=auth(key))
            .json()["data"]] == [ids[0]]
    assert [j["id"] for j in client.get("/v1/jobs?status=cancelled", headers=auth(key)).json()["data"]] == [ids[1]]
    response = client.get("/v1/jobs?status=done", headers=auth(key))
    assert response.status_code == 400 and response.json()["error"]["param"] == "status"
    # Batch lines are for keys with the batch scope.
    refused = client.get("/v1/jobs?batch_id=batch_nope", headers=auth(key))
    assert refused.status_code == 403 and "batch" in refused.json()["error"]["message"]
    batch_key = make_key(tenant, "inference,batch")
    assert client.get("/v1/jobs?batch_id=batch_nope", headers=auth(batch_key)).json()["data"] == []


def test_tenant_isolation_on_every_id_route_and_the_list(client, make_key, tenant):
    mine, theirs = make_key(tenant), make_key(f"other-{tenant}")
    job_id = _create(client, mine)["id"]
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(mine)).status_code == 200
    for method, path in [("GET", f"/v1/jobs/{job_id}"), ("POST", f"/v1/jobs/{job_id}/cancel"),
                         ("GET", f"/v1/jobs/{job_id}/events"),
                         ("GET", "/v1/jobs/job_doesnotexist"), ("POST", "/v1/jobs/job_doesnotexist/cancel"),
                         ("GET", "/v1/jobs/job_doesnotexist/events")]:
        response = client.request(method, path, headers=auth(theirs))
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["code"] == "not_found"
    assert client.get("/v1/jobs", headers=auth(theirs)).json()["data"] == []
    response = client.get(f"/v1/jobs?after={job_id}", headers=auth(theirs))
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    # The other tenant's cancel did nothing.
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(mine)).json()["status"] == "queued"


def test_idempotency_key_returns_the_same_job(client, make_key, tenant, db_session):
    key = make_key(tenant)
    first = _create(client, key, headers={"Idempotency-Key": "abc-1"})
    again = _create(client, key, headers={"Idempotency-Key": "abc-1"})
    assert again["id"] == first["id"]
    # The same key for a different request is a client bug: 409, and no new job.
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions",
                                             "body": chat_body("something else"), "metadata": {"k": "v"}},
                           headers=auth(key) | {"Idempotency-Key": "abc-1"})
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "idempotency_key_reused"
    assert first["id"] in response.json()["error"]["message"]
    other = _create(client, key, headers={"Idempotency-Key": "abc-2"})
    assert other["id"] != first["id"]
    # The same key from another tenant is another job.
    elsewhere = _create(client, make_key(f"x-{tenant}"), headers={"Idempotency-Key": "abc-1"})
    assert elsewhere["id"] != first["id"]
    count = len(db_session.scalars(select(Job.id).where(Job.tenant == tenant)).all())
    assert count == 2


def test_cancel_a_queued_job(client, make_key, tenant, redis_client, settings):
    key = make_key(tenant)
    job_id = _create(client, key)["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key))
    assert response.status_code == 200, response.text
    job = response.json()
    assert job["status"] == "cancelled" and job["cancel_requested_at"] is not None
    assert job["timings"]["finished_at"] is not None
    keys = RedisKeys.from_settings(settings)
    assert redis_client.exists(keys.job_cancel(job_id))   # what the worker checks when it takes it
    # Followers of the job see its end.
    events = client.get(f"/v1/jobs/{job_id}/events", headers=auth(key)).text
    assert '"finish_reason":"abort"' in events
    # Cancelling again is harmless.
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key)).json()["status"] == "cancelled"


def test_an_idempotency_key_expires(make_client, make_key, tenant, db_sessionmaker):
    client = make_client(idempotency_key_ttl_seconds=3600)
    key = make_key(tenant)
    first = _create(client, key, headers={"Idempotency-Key": "daily-report"})
    assert _create(client, key, headers={"Idempotency-Key": "daily-report"})["id"] == first["id"]
    with db_sessionmaker.begin() as session:      # two hours later
        session.execute(update(Job).where(Job.id == first["id"])
                        .values(created_at=func.now() - func.make_interval(0, 0, 0, 0, 2)))
    later = _create(client, key, headers={"Idempotency-Key": "daily-report"})
    assert later["id"] != first["id"]
    assert _create(client, key, headers={"Idempotency-Key": "daily-report"})["id"] == later["id"]
    assert client.get(f"/v1/jobs/{first['id']}", headers=auth(key)).status_code == 200   # the old job stays


def test_backpressure_503_when_the_queue_is_full(make_client, make_key, tenant, model_dir):
    model = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{model}={model_dir}@512", max_queue_depth=2)
    key, other = make_key(tenant), make_key(f"{tenant}-other")
    body = chat_body(model=model)
    _create(client, key, body)          # each tenant may hold half the queue
    _create(client, other, body)
    response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body},
                           headers=auth(make_key(f"{tenant}-third")))
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "queue_full"
    assert int(response.headers["Retry-After"]) >= 1


def test_one_tenant_filling_its_queue_share_leaves_room_for_another(make_client, make_key, tenant, model_dir):
    model = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{model}={model_dir}@512", max_queue_depth=4)
    greedy, other = make_key(tenant), make_key(f"{tenant}-other")
    body = chat_body(model=model)
    _create(client, greedy, body)
    _create(client, greedy, body)        # its share: half of 4
    refused = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body},
                          headers=auth(greedy))
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "tenant_queue_full" and "REIN_TENANT_QUEUE_SHARE" in error["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    _create(client, other, body)         # the other tenant still gets in
    _create(client, other, body)


def test_priority_and_service_tier_place_the_job_in_the_queue(make_client, make_key, tenant, db_session,
                                                               redis_client, model_dir):
    """`priority` moves a job back within the interactive class (its queue step too); `service_tier:
    "flex"` puts it in the batch class, on a batch queue shard; both are stored on the job."""
    from rein.core.priorities import PRIORITY_BATCH
    from rein.jobs.queues import priority_lists

    model = f"m{secrets.token_hex(3)}"
    client = make_client(models=f"{model}={model_dir}@512")
    settings = client.app.state.settings
    key = make_key(tenant)
    plain = _create(client, key, chat_body(model=model))
    later = _create(client, key, chat_body(model=model, priority=3, service_tier="auto"))
    capped = _create(client, key, chat_body(model=model, priority=40))
    flex = _create(client, key, chat_body(model=model, priority=1, service_tier="flex"))
    stored = {name: db_session.get(Job, job["id"]).priority
              for name, job in (("plain", plain), ("later", later), ("capped", capped), ("flex", flex))}
    assert stored == {"plain": 0, "later": 3, "capped": PRIORITY_BATCH - 1, "flex": PRIORITY_BATCH + 1}

    def waiting(step: int) -> list[str]:
        ids = []
        for queue in priority_lists(settings, model, step):
            for raw in redis_client.lrange(queue, 0, -1):
                body = json.loads(__import__("base64").b64decode(json.loads(raw)["body"]))
                ids.append(body[0][0]["job_id"])
        return ids

    assert waiting(0) == [plain["id"]] and waiting(3) == [later["id"]]
    assert waiting(PRIORITY_BATCH - 1) == [capped["id"]] and waiting(PRIORITY_BATCH + 1) == [flex["id"]]


def test_bad_priority_or_service_tier_is_a_400_naming_the_field(client, make_key, tenant):
    key = make_key(tenant)
    for body, param in ((chat_body(priority="high"), "priority"), (chat_body(service_tier="scale"), "service_tier")):
        for path, payload in (("/v1/chat/completions", body),
                              ("/v1/jobs", {"endpoint": "/v1/chat/completions", "body": body})):
            response = client.post(path, json=payload, headers=auth(key))
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] in (param, f"body.{param}") and param in error["message"], error
