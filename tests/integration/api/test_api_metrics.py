"""GET /metrics of the API on real Postgres and Redis: refusals (401, 403, 429) counted by route
template and status, rate-limit refusals by key id and limit, queue depth per model and
priority read from the broker's lists."""

from __future__ import annotations

import secrets
import time

import pytest
from api_support import auth, chat_body
from prometheus_client.parser import text_string_to_metric_families

from rein.core.priorities import PRIORITY_BATCH
from rein.jobs.queues import enqueue_job
from rein.store.messages import JobMessage


@pytest.fixture(autouse=True)
def not_at_a_window_edge():
    """Fixed one-minute rate-limit windows: keep a burst inside one."""
    if time.time() % 60 > 55:
        time.sleep(60 - time.time() % 60 + 0.1)


@pytest.fixture
def scrape(make_key):
    """scrape(client) -> {(sample name, labels): value}, parsed from the exposition as
    Prometheus would, with a key holding the `admin` scope."""
    admin = make_key(f"ops-{secrets.token_hex(3)}", "admin")

    def get(client) -> dict[tuple[str, frozenset], float]:
        return parse(client.get("/metrics", headers=auth(admin)))

    return get


def parse(response) -> dict[tuple[str, frozenset], float]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def requests_total(samples, route: str, method: str, status: int) -> float:
    labels = frozenset({"route": route, "method": method, "status": str(status)}.items())
    return samples.get(("rein:api_requests_total", labels), 0.0)


def submit(client, key: str):
    return client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body()},
                       headers=auth(key))


def test_refusals_are_counted_by_route_and_status(client, make_key, tenant, scrape):
    good = make_key(tenant, rpm=2)
    no_scope = make_key(tenant, scopes="usage")
    statuses = [submit(client, good).status_code for _ in range(3)]
    assert statuses == [202, 202, 429]
    assert submit(client, "rein_000000000000_" + "x" * 43).status_code == 401
    assert client.post("/v1/jobs", json={}).status_code == 401
    assert submit(client, no_scope).status_code == 403
    job_id = submit(client, make_key(tenant)).json()["id"]
    assert client.get(f"/v1/jobs/{job_id}", headers=auth(good)).status_code == 200

    samples = scrape(client)
    assert requests_total(samples, "/v1/jobs", "POST", 202) == 3
    assert requests_total(samples, "/v1/jobs", "POST", 429) == 1
    assert requests_total(samples, "/v1/jobs", "POST", 401) == 2
    assert requests_total(samples, "/v1/jobs", "POST", 403) == 1
    assert requests_total(samples, "/v1/jobs/{job_id}", "GET", 200) == 1
    assert samples[("rein:api_request_duration_seconds_count", frozenset({"route": "/v1/jobs"}.items()))] == 7
    key_id = good.split("_")[1]
    limited = {labels: value for (name, labels), value in samples.items()
               if name == "rein:api_rate_limited_total"}
    assert limited == {frozenset({"key_id": key_id, "kind": "requests"}.items()): 1.0}
    # A raw path never becomes a label.
    assert not any(job_id in str(labels) for _, labels in samples)


def test_tokens_limit_refusal_is_labelled_tokens(client, make_key, tenant, scrape):
    key = make_key(tenant, tpm=10)
    assert submit(client, key).status_code == 429            # prompt + 8 max_tokens > 10
    samples = scrape(client)
    labels = frozenset({"key_id": key.split("_")[1], "kind": "tokens"}.items())
    assert samples[("rein:api_rate_limited_total", labels)] == 1


def test_queue_depth_per_model_and_priority(client, make_key, tenant, scrape):
    def depth(samples, priority: str) -> float:
        return samples[("rein:queue_depth", frozenset({"model_name": "tiny", "priority": priority}.items()))]

    samples = scrape(client)
    assert depth(samples, "interactive") == 0 and depth(samples, "batch") == 0
    key = make_key(tenant)
    for _ in range(3):
        assert submit(client, key).status_code == 202          # no worker runs: they stay queued
    for i in range(2):
        enqueue_job(client.app.state.celery, JobMessage(
            job_id=f"batch-{i}", model="tiny", endpoint="/v1/completions", prompt_token_ids=[1, 2],
            sampling={"max_tokens": 1}, priority=PRIORITY_BATCH))
    samples = scrape(client)
    assert depth(samples, "interactive") == 3
    assert depth(samples, "batch") == 2


def test_metrics_need_an_admin_key_unless_public(client, make_client, make_key, tenant):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers=auth(make_key(tenant))).status_code == 403
    assert client.get("/metrics", headers=auth(make_key(tenant, "admin"))).status_code == 200
    assert make_client(metrics_public=True).get("/metrics").status_code == 200
