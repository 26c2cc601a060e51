"""Webhooks for batches against real Postgres, Redis and HTTP: an admin sets a tenant's endpoint
(the signing secret shown once), a batch reaching a final status writes one event in the same
transaction, and the API's deliverer POSTs it to a real HTTP server started here, where the
official openai client's `webhooks.unwrap` verifies it. A receiver that refuses connections and
then answers 500 gets the event again, with backoff, every attempt recorded and every delivery
carrying the same webhook-id, and nothing after the success. Failed, cancelled and expired
batches send their own types; a private address is refused when set."""

from __future__ import annotations

import json
import time

import openai
import pytest
from api_support import auth, jsonl, line
from sqlalchemy import select
from support import free_port, wait_for
from test_batches import batch_jobs, create, wait_status
from webhook_receiver import Receiver

from rein.store.tables import WebhookAttempt, WebhookEvent

pytestmark = pytest.mark.usefixtures("end_leftover_batches")

# Deliveries to the test's own server on 127.0.0.1 over http: the operator's settings allow it.
LOCAL = {"webhook_allow_private": True, "webhook_allow_http": True, "webhook_poll_seconds": 0.05,
         "batch_poll_seconds": 0.05}


@pytest.fixture
def receivers():
    started: list[Receiver] = []

    def start(*args, **kwargs) -> Receiver:
        started.append(Receiver(*args, **kwargs))
        return started[-1]

    yield start
    for receiver in started:
        receiver.close()


def set_endpoint(client, admin: str, tenant: str, url: str, **extra) -> dict:
    response = client.put(f"/v1/tenants/{tenant}/webhook_endpoint", headers=auth(admin), json={"url": url, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def events_of(sessions, batch_id: str) -> list[WebhookEvent]:
    with sessions() as session:
        return list(session.scalars(select(WebhookEvent).where(WebhookEvent.batch_id == batch_id)))


def attempts_of(sessions, event_id: str) -> list[WebhookAttempt]:
    with sessions() as session:
        return list(session.scalars(select(WebhookAttempt).where(WebhookAttempt.event_id == event_id)
                                    .order_by(WebhookAttempt.attempt)))


def test_a_completed_batch_is_delivered_once_and_verified_by_the_openai_client(
        make_client, make_key, tenant, tmp_path, db_sessionmaker, fake_worker, receivers):
    client = make_client(files_dir=str(tmp_path / "files"), **LOCAL)
    admin, user = make_key(tenant, "admin"), make_key(tenant, "batch")
    receiver = receivers()
    path = f"/v1/tenants/{tenant}/webhook_endpoint"

    # Only an admin key sets it; a tenant no key belongs to is a 404.
    assert client.put(path, headers=auth(user), json={"url": receiver.url}).status_code == 403
    assert client.get(path, headers=auth(admin)).status_code == 404
    missing = client.put(f"/v1/tenants/{tenant}-nobody/webhook_endpoint", headers=auth(admin),
                         json={"url": receiver.url})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "tenant_not_found"
    bad_types = client.put(path, headers=auth(admin), json={"url": receiver.url, "event_types": ["batch.done"]})
    assert bad_types.status_code == 400 and "batch.done" in bad_types.json()["error"]["message"]

    first = set_endpoint(client, admin, tenant, receiver.url)
    assert first["signing_secret"].startswith("whsec_") and first["object"] == "webhook_endpoint"
    assert first["event_types"] == ["batch.completed", "batch.failed", "batch.cancelled", "batch.expired"]
    # Rotation: setting it again makes a new secret; reads never show it.
    endpoint = set_endpoint(client, admin, tenant, receiver.url)
    secret = endpoint["signing_secret"]
    assert secret != first["signing_secret"] and endpoint["id"] != first["id"]
    read = client.get(path, headers=auth(admin)).json()
    assert "signing_secret" not in read and secret not in json.dumps(read)
    assert read["signing_secret_hint"] == f"whsec_…{secret[-4:]}" and read["url"] == receiver.url

    batch = create(client, user, jsonl(line("only")))
    wait_status(client, user, batch["id"], "in_progress")
    assert events_of(db_sessionmaker, batch["id"]) == []          # nothing before the final status
    fake_worker.record(batch_jobs(db_sessionmaker, batch["id"])[0].id, "done", [1])
    done = wait_status(client, user, batch["id"], "completed")

    wait_for(lambda: receiver.requests, 10, "the webhook delivery")
    headers, body = receiver.requests[0]
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed" and event.data.id == batch["id"] and event.object == "event"
    assert event.id.startswith("evt_") and headers["webhook-id"] == event.id
    assert event.created_at == done["completed_at"]
    with pytest.raises(openai.InvalidWebhookSignatureError):    # the rotated-out secret no longer verifies
        openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=first["signing_secret"])

    [row] = wait_for(lambda: [e for e in events_of(db_sessionmaker, batch["id"]) if e.status == "delivered"],
                     10, "the event marked delivered")
    assert row.id == event.id and row.attempts == 1 and row.delivered_at is not None
    [attempt] = attempts_of(db_sessionmaker, row.id)
    assert (attempt.attempt, attempt.status_code, attempt.error, attempt.url) == (1, 200, None, receiver.url)
    listed = client.get(f"{path}/events", headers=auth(admin)).json()["data"]
    assert [(e["id"], e["status"], len(e["attempts"])) for e in listed] == [(event.id, "delivered", 1)]
    assert len(receiver.requests) == 1
    metrics = client.get("/metrics", headers=auth(admin)).text
    assert 'rein:webhook_deliveries_total{result="success"} 1.0' in metrics

    deleted = client.delete(path, headers=auth(admin)).json()
    assert deleted == {"id": endpoint["id"], "object": "webhook_endpoint.deleted", "deleted": True}
    assert client.get(path, headers=auth(admin)).status_code == 404


def test_a_receiver_down_for_a_while_gets_the_event_with_backoff_and_the_same_id(
        make_client, make_key, tenant, tmp_path, db_sessionmaker, receivers):
    client = make_client(files_dir=str(tmp_path / "files"), webhook_backoff_seconds=0.3,
                         webhook_backoff_max_seconds=5, **LOCAL)
    admin, user = make_key(tenant, "admin"), make_key(tenant, "batch")
    port = free_port()                       # nothing listens there yet: connections are refused
    url = f"http://127.0.0.1:{port}/hooks/rein"
    secret = set_endpoint(client, admin, tenant, url)["signing_secret"]

    batch = create(client, user, b"{not json\n")      # fails validation: batch.failed
    wait_status(client, user, batch["id"], "failed")
    [event] = wait_for(lambda: events_of(db_sessionmaker, batch["id"]), 10, "the event")
    wait_for(lambda: len(attempts_of(db_sessionmaker, event.id)) >= 2, 20, "two refused attempts")
    receiver = receivers(statuses=[500, 500], port=port)   # up, but failing twice more
    wait_for(lambda: events_of(db_sessionmaker, batch["id"])[0].status == "delivered", 30, "the delivery")

    attempts = attempts_of(db_sessionmaker, event.id)
    assert [a.attempt for a in attempts] == list(range(1, len(attempts) + 1))
    refused, answered = attempts[:-3], attempts[-3:]
    assert len(refused) >= 2 and all(a.status_code is None and "Connect" in a.error for a in refused)
    assert [(a.status_code, a.error) for a in answered] == [
        (500, "the receiver answered 500"), (500, "the receiver answered 500"), (200, None)]
    # Backoff: each wait longer than the one before (doubling, jitter at most +-25%), poll aside.
    gaps = [(b.started_at - a.started_at).total_seconds() for a, b in zip(attempts, attempts[1:], strict=False)]
    assert gaps[0] >= 0.3 * 0.75 - 0.05 and gaps[-1] > gaps[0], gaps

    # Three deliveries reached the receiver, each the same event under the same webhook-id.
    assert len(receiver.requests) == 3
    assert {headers["webhook-id"] for headers, _ in receiver.requests} == {event.id}
    assert len({body for _, body in receiver.requests}) == 1
    for headers, body in receiver.requests:
        verified = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
        assert verified.type == "batch.failed" and verified.data.id == batch["id"]
    time.sleep(1.5)
    assert len(receiver.requests) == 3                 # no duplicate after the success
    assert events_of(db_sessionmaker, batch["id"])[0].attempts == len(attempts)


def test_failed_cancelled_and_expired_batches_send_their_types(
        make_client, make_key, tenant, tmp_path, db_sessionmaker, receivers):
    client = make_client(files_dir=str(tmp_path / "files"), batch_completion_window_seconds=2.0, **LOCAL)
    admin, user = make_key(tenant, "admin"), make_key(tenant, "batch")
    receiver = receivers()
    secret = set_endpoint(client, admin, tenant, receiver.url)["signing_secret"]

    failed = create(client, user, jsonl(line("a", model="gpt-nope")))
    cancelled = create(client, user, jsonl(line("b"), line("c")))
    client.post(f"/v1/batches/{cancelled['id']}/cancel", headers=auth(user))
    expired = create(client, user, jsonl(line("d")))
    wait_status(client, user, failed["id"], "failed")
    wait_status(client, user, cancelled["id"], "cancelled")
    wait_status(client, user, expired["id"], "expired")

    wait_for(lambda: len(receiver.requests) >= 3, 15, "three deliveries")
    got = {}
    for headers, body in receiver.requests:
        event = openai.OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
        got[event.data.id] = event.type
    assert got == {failed["id"]: "batch.failed", cancelled["id"]: "batch.cancelled",
                   expired["id"]: "batch.expired"}
    for batch in (failed, cancelled, expired):
        assert len(events_of(db_sessionmaker, batch["id"])) == 1


def test_only_subscribed_types_are_written(make_client, make_key, tenant, tmp_path, db_sessionmaker, receivers):
    client = make_client(files_dir=str(tmp_path / "files"), **LOCAL)
    admin, user = make_key(tenant, "admin"), make_key(tenant, "batch")
    set_endpoint(client, admin, tenant, receivers().url, event_types=["batch.completed"])
    batch = create(client, user, b"{not json\n")
    wait_status(client, user, batch["id"], "failed")
    assert events_of(db_sessionmaker, batch["id"]) == []


@pytest.mark.parametrize("url", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/hook",
                                 "http://[::1]/hook", "http://[::ffff:127.0.0.1]:8080/",
                                 "http://localhost:9/hook"])
def test_a_private_destination_is_refused_when_set(make_client, make_key, tenant, tmp_path, url):
    client = make_client(files_dir=str(tmp_path / "files"), webhook_allow_http=True)   # private: not allowed
    admin = make_key(tenant, "admin")
    response = client.put(f"/v1/tenants/{tenant}/webhook_endpoint", headers=auth(admin), json={"url": url})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_webhook_url" and error["param"] == "url"
    assert "points into a network rein does not send to" in error["message"]
    assert "REIN_WEBHOOK_ALLOW_PRIVATE" in error["message"]
    assert client.get(f"/v1/tenants/{tenant}/webhook_endpoint", headers=auth(admin)).status_code == 404


def test_plain_http_is_refused_by_default(make_client, make_key, tenant, tmp_path):
    client = make_client(files_dir=str(tmp_path / "files"))
    response = client.put(f"/v1/tenants/{tenant}/webhook_endpoint", headers=auth(make_key(tenant, "admin")),
                          json={"url": "http://hooks.example.com/"})
    assert response.status_code == 400 and "REIN_WEBHOOK_ALLOW_HTTP" in response.json()["error"]["message"]
