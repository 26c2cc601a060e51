"""Rate limits per key in Redis: a burst admits exactly the limit, then 429 with Retry-After."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
from api_support import auth, chat_body

from rein.jobs.ratelimit import RateLimiter, RateLimitExceeded
from rein.store.keys import KeyInfo
from rein.store.redis_keys import RedisKeys


@pytest.fixture(autouse=True)
def not_at_a_window_edge():
    """RPM's fixed one-minute windows: keep a burst inside one."""
    if time.time() % 60 > 55:
        time.sleep(60 - time.time() % 60 + 0.1)


def _post(client, key, **extra):
    return client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body(**extra)},
                       headers=auth(key))


def test_rpm_burst_admits_exactly_the_limit(client, make_key, tenant):
    key = make_key(tenant, rpm=3)
    statuses = [_post(client, key).status_code for _ in range(5)]
    assert statuses == [202, 202, 202, 429, 429]
    response = _post(client, key)
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
    assert "Limit 3" in error["message"]
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    # Another key of the same tenant has its own budget.
    assert _post(client, make_key(tenant, rpm=3)).status_code == 202


def test_tpm_counts_prompt_plus_max_tokens(make_client, make_key, tenant, db_session):
    client = make_client(tpm_burst_seconds=60)       # a bucket of the whole TPM
    key = make_key(tenant, tpm=100)
    first = _post(client, key, max_tokens=40)
    assert first.status_code == 202
    from rein.store.tables import Job

    prompt = db_session.get(Job, first.json()["id"]).prompt_tokens
    budget_left = 100 - (prompt + 40)
    assert _post(client, key, max_tokens=budget_left - prompt).status_code == 202   # exactly the rest
    # Empty: a request waits for the refill (100 tokens a minute), at most 0.6 s a token.
    response = _post(client, key, max_tokens=20)
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "tokens"
    assert 1 <= int(response.headers["Retry-After"]) <= math.ceil(0.6 * (prompt + 20))


def test_default_limits_from_settings(make_client, make_key, tenant):
    client = make_client(default_rpm=2)
    key = make_key(tenant)
    assert [_post(client, key).status_code for _ in range(3)] == [202, 202, 429]


def test_concurrent_burst_is_exact_across_clients(settings, redis_url, tenant):
    """50 concurrent checks from separate connections (as from many replicas), limit 10."""
    keys = RedisKeys.from_settings(settings)
    info = KeyInfo(f"k-{tenant}", "n", tenant, ("inference",), 10, 10_000, None, None)  # type: ignore[arg-type]
    now = time.time()

    def attempt(_: int) -> bool:
        limiter = RateLimiter(redis.Redis.from_url(redis_url), keys, settings)
        try:
            limiter.check(info, 100, now=now)
            return True
        except RateLimitExceeded:
            return False

    with ThreadPoolExecutor(max_workers=25) as pool:
        admitted = sum(pool.map(attempt, range(50)))
    assert admitted == 10
