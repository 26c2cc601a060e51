"""Group commit (rein.api.intake): several requests admitted, stored and queued together.

`JobIntake.commit` is called here with hand-built groups, so each case is exact rather than
depending on which requests happen to arrive together; the group commit that forms the
groups is tested on its own in tests/unit/test_group_commit.py.
"""

from __future__ import annotations

import base64
import json
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from api_support import auth, chat_body
from sqlalchemy import select

from rein.jobs.errors import APIError
from rein.jobs.queues import make_celery, queue_keys
from rein.store.keys import authenticate
from rein.store.tables import Job


@pytest.fixture(autouse=True)
def not_at_a_window_edge():
    """Fixed one-minute rate-limit windows: keep each test inside one."""
    if time.time() % 60 > 55:
        time.sleep(60 - time.time() % 60 + 0.1)


@pytest.fixture
def model() -> str:
    """The name of a model served only by this test, so its queue starts empty."""
    return f"m{secrets.token_hex(3)}"


def _queued_job_ids(redis_client, settings, model):
    ids = []
    for queue in queue_keys(settings, model):
        for raw in redis_client.lrange(queue, 0, -1):
            body = json.loads(base64.b64decode(json.loads(raw)["body"]))
            ids.append(body[0][0]["job_id"])
    return ids


def test_a_group_is_admitted_in_order_stored_and_queued_once(make_client, make_key, tenant, model,
                                                             model_dir, db_session, redis_client):
    client = make_client(models=f"{model}={model_dir}@512", max_queue_depth=5, tenant_queue_share=1)
    intake, settings = client.app.state.intake, client.app.state.settings
    limited = authenticate(db_session, make_key(tenant, rpm=2))
    free = authenticate(db_session, make_key(tenant))
    body = chat_body(model=model)
    group = [intake.validate(k, "/v1/chat/completions", body, None, None)
             for k in (limited, free, limited, free, limited, free, free)]

    outcomes = intake.commit(group)

    accepted = [*outcomes[:4], outcomes[5]]
    assert all(isinstance(o, tuple) and o[0].status == "queued" for o in accepted), outcomes
    # The key's third request is over its 2 RPM (and, refused, does not count as queued);
    # the last one finds the queue holding 5: the 5 admitted before it in the same group.
    assert isinstance(outcomes[4], APIError) and outcomes[4].status_code == 429
    assert isinstance(outcomes[6], APIError) and outcomes[6].status_code == 503
    assert outcomes[6].to_dict()["error"]["code"] == "queue_full"
    ids = [job.id for job, _ in accepted]
    stored = db_session.scalars(select(Job.id).where(Job.model == model)).all()
    assert sorted(stored) == sorted(ids)
    assert sorted(_queued_job_ids(redis_client, settings, model)) == sorted(ids)
    # Each stored row is the job its request got back: the database filled in its times.
    for job, _ in accepted:
        row = db_session.get(Job, job.id)
        assert row.queued_at == job.queued_at and row.attempt == job.attempt


def test_a_row_postgres_refuses_fails_its_own_request_only(make_client, make_key, tenant, model, model_dir,
                                                           db_session, redis_client):
    """The net under intake's validation: a row the group INSERT cannot take (here a token id
    past Postgres' integer, put in after validation) fails its own request with a 400; the
    other tenant's requests of the same group are stored and queued."""
    client = make_client(models=f"{model}={model_dir}@512")
    intake, settings = client.app.state.intake, client.app.state.settings
    bad_key = authenticate(db_session, make_key(tenant))
    other = authenticate(db_session, make_key(f"{tenant}-other"))
    group = [intake.validate(k, "/v1/chat/completions", chat_body(model=model), None, None)
             for k in (other, bad_key, other, other)]
    group[1].job.prompt_token_ids[0] = 2**40

    outcomes = intake.commit(group)

    assert isinstance(outcomes[1], APIError) and outcomes[1].status_code == 400, outcomes[1]
    assert "cannot be stored" in outcomes[1].message
    good = [outcomes[i][0].id for i in (0, 2, 3)]
    assert sorted(db_session.scalars(select(Job.id).where(Job.model == model)).all()) == sorted(good)
    assert sorted(_queued_job_ids(redis_client, settings, model)) == sorted(good)


def test_one_idempotency_key_twice_in_a_group_makes_one_job(make_client, make_key, tenant, model,
                                                            model_dir, db_session, redis_client):
    client = make_client(models=f"{model}={model_dir}@512")
    intake, settings = client.app.state.intake, client.app.state.settings
    key = authenticate(db_session, make_key(tenant))
    body = chat_body(model=model)
    other = chat_body("a different request", model=model)
    group = [intake.validate(key, "/v1/chat/completions", b, None, "same-key") for b in (body, body, other)]

    first, second, third = intake.commit(group)

    assert first[0].id == second[0].id and second[1] is None      # the retry gets the first job
    assert isinstance(third, APIError) and third.status_code == 409
    assert third.to_dict()["error"]["code"] == "idempotency_key_reused"
    assert db_session.scalars(select(Job.id).where(Job.model == model)).all() == [first[0].id]
    assert _queued_job_ids(redis_client, settings, model) == [first[0].id]


def test_jobs_that_cannot_be_queued_are_failed_not_lost(make_client, make_key, tenant, model, model_dir,
                                                        db_session):
    client = make_client(models=f"{model}={model_dir}@512")
    intake = client.app.state.intake
    key = authenticate(db_session, make_key(tenant))
    group = [intake.validate(key, "/v1/chat/completions", chat_body(model=model), None, None)
             for _ in range(2)]
    # A broker nobody listens on, and no retries: the publish fails at once.
    dead = make_celery(intake.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"}))
    dead.conf.broker_connection_retry = False
    dead.conf.broker_connection_max_retries = 0
    dead.conf.task_publish_retry = False
    intake.celery = dead
    try:
        outcomes = intake.commit(group)
    finally:
        dead.close()

    assert all(isinstance(o, APIError) and o.status_code == 503 for o in outcomes)
    assert outcomes[0].to_dict()["error"]["code"] == "queue_unavailable"
    rows = db_session.scalars(select(Job).where(Job.model == model)).all()
    assert len(rows) == 2 and {r.status for r in rows} == {"failed"}   # never run, never lost
    assert all(r.error["code"] == "queue_unavailable" for r in rows)


def test_concurrent_requests_are_all_accepted_exactly_once(make_client, make_key, tenant, model,
                                                           model_dir, db_session, redis_client):
    """Through HTTP: 40 requests at once go through the committer; each gets its own job."""
    client = make_client(models=f"{model}={model_dir}@512")
    key = make_key(tenant)

    def post(i: int) -> str:
        response = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions",
                                                 "body": chat_body(f"request {i}", model=model)},
                               headers=auth(key))
        assert response.status_code == 202, response.text
        return response.json()["id"]

    with ThreadPoolExecutor(max_workers=16) as pool:
        ids = list(pool.map(post, range(40)))
    assert len(set(ids)) == 40
    rows = db_session.scalars(select(Job).where(Job.model == model)).all()
    assert sorted(r.id for r in rows) == sorted(ids)
    # Each request's own prompt went into its own job.
    assert {r.params["body"]["messages"][0]["content"] for r in rows} == {f"request {i}" for i in range(40)}
    assert sorted(_queued_job_ids(redis_client, client.app.state.settings, model)) == sorted(ids)
