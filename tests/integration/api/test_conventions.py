"""HTTP conventions OpenAI's and vLLM's clients expect: x-request-id, the x-ratelimit-* headers
counting down request by request, x-should-retry (checked through the official `openai`
client: a job that ends cancelled is not submitted again), CORS (off by default), /health,
and the TPM charge of a request without max_tokens (prompt + the completion estimate,
settled against the real usage)."""

from __future__ import annotations

import math
import re
import threading
import time

import openai
import pytest
from api_support import auth, chat_body
from sqlalchemy import select

from rein.jobs.ratelimit import reset_duration, settle_tokens
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job

RESET = re.compile(r"^(\d+ms|\d+s|1m0s)$")


@pytest.fixture(autouse=True)
def not_at_a_window_edge():
    """RPM's fixed one-minute windows: keep each test's requests inside one."""
    if time.time() % 60 > 50:
        time.sleep(60 - time.time() % 60 + 0.1)


def _post_job(client, key, headers=None, **body):
    return client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": chat_body(**body)},
                       headers={**auth(key), **(headers or {})})


def _jobs_of(db_sessionmaker, tenant: str) -> list[Job]:
    with db_sessionmaker() as session:
        return list(session.scalars(select(Job).where(Job.tenant == tenant).order_by(Job.created_at)))


# -- x-request-id -----------------------------------------------------------------------------


def test_request_id_is_the_job_id_on_job_responses(client, make_key, tenant):
    key = make_key(tenant)
    response = _post_job(client, key, headers={"x-request-id": "from-the-client"})
    assert response.status_code == 202
    assert response.headers["x-request-id"] == response.json()["id"]
    assert "x-should-retry" not in response.headers


def test_request_id_elsewhere_is_fresh_or_the_clients(client, make_key, tenant):
    first, second = client.get("/healthz"), client.get("/healthz")
    assert first.headers["x-request-id"].startswith("req_")
    assert first.headers["x-request-id"] != second.headers["x-request-id"]
    assert client.get("/healthz", headers={"x-request-id": "proxy-42"}).headers["x-request-id"] == "proxy-42"
    # Not a plain token: not echoed.
    assert client.get("/healthz", headers={"x-request-id": "a b"}).headers["x-request-id"].startswith("req_")
    # Errors carry it too, with x-should-retry: false.
    for response in (client.get("/v1/nowhere"), client.get("/v1/jobs/job_nope", headers=auth(make_key(tenant))),
                     client.get("/v1/jobs")):
        assert response.status_code in (401, 404)
        assert response.headers["x-request-id"].startswith("req_")
        assert response.headers["x-should-retry"] == "false"


def test_health_alias(client):
    assert client.get("/health").json() == client.get("/healthz").json()


# -- rate-limit headers -----------------------------------------------------------------------


def _refilled_within(got: int, expected: int, tpm: int, seconds: float) -> bool:
    """A TPM bucket's remaining tokens: what was charged, plus at most `seconds` of refill."""
    return expected <= got <= expected + math.ceil(tpm / 60 * seconds)


def test_ratelimit_headers_count_down(make_client, make_key, tenant, db_sessionmaker):
    client = make_client(tpm_burst_seconds=60)       # a TPM bucket of the whole minute
    key = make_key(tenant, rpm=5, tpm=10_000)
    seen = []
    began = time.monotonic()
    for _ in range(3):
        response = _post_job(client, key, max_tokens=20)
        assert response.status_code == 202
        seen.append(response.headers)
    elapsed = time.monotonic() - began
    prompt = _jobs_of(db_sessionmaker, tenant)[0].prompt_tokens
    assert [h["x-ratelimit-limit-requests"] for h in seen] == ["5"] * 3
    assert [h["x-ratelimit-remaining-requests"] for h in seen] == ["4", "3", "2"]
    remaining = [int(h["x-ratelimit-remaining-tokens"]) for h in seen]
    assert remaining[0] == 10_000 - (prompt + 20)           # charged from a full bucket
    for n in (2, 3):                                           # the bucket refills as they come
        assert _refilled_within(remaining[n - 1], 10_000 - n * (prompt + 20), 10_000, elapsed), remaining
    for headers in seen:
        assert headers["x-ratelimit-limit-tokens"] == "10000"
        assert RESET.match(headers["x-ratelimit-reset-requests"]), headers["x-ratelimit-reset-requests"]
        # The bucket is full again once what was charged has refilled (0.006 s a token).
        assert RESET.match(headers["x-ratelimit-reset-tokens"]), headers["x-ratelimit-reset-tokens"]
    assert seen[0]["x-ratelimit-reset-tokens"] == f"{math.ceil(0.006 * (prompt + 20) * 1000)}ms"


def test_keys_without_limits_get_no_ratelimit_headers(client, make_key, tenant):
    response = _post_job(client, make_key(tenant))
    assert response.status_code == 202
    assert not [name for name in response.headers if name.startswith("x-ratelimit-")]
    # A key with only an RPM limit gets only the request headers.
    response = _post_job(client, make_key(tenant, rpm=10))
    assert response.headers["x-ratelimit-remaining-requests"] == "9"
    assert "x-ratelimit-limit-tokens" not in response.headers


def test_429_should_retry_unless_it_can_never_fit(client, make_key, tenant):
    key = make_key(tenant, rpm=1)
    assert _post_job(client, key).status_code == 202
    refused = _post_job(client, key)
    assert refused.status_code == 429
    assert refused.headers["x-should-retry"] == "true"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    too_large = _post_job(client, make_key(tenant, tpm=50), max_tokens=100)
    assert too_large.status_code == 429 and "Request too large" in too_large.json()["error"]["message"]
    assert too_large.headers["x-should-retry"] == "false"


def test_reset_duration_format():
    assert [reset_duration(s) for s in (0.25, 1, 1.2, 59.5, 60)] == ["250ms", "1s", "2s", "1m0s", "1m0s"]


# -- TPM: the completion estimate, settled against usage --------------------------------------


def test_tpm_without_max_tokens_charges_the_estimate_then_settles(make_client, make_key, tenant, db_sessionmaker,
                                                                 redis_client, settings, fake_worker):
    # A 400-token TPM under a 512-token context: charged the whole context, this key could
    # never send a chat request without max_tokens.
    client = make_client(tpm_completion_estimate=100, tpm_burst_seconds=60)
    key = make_key(tenant, tpm=400)
    began = time.monotonic()
    body = chat_body()
    del body["max_tokens"]
    first = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth(key))
    assert first.status_code == 202, first.text
    job = _jobs_of(db_sessionmaker, tenant)[0]
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 400 - (job.prompt_tokens + 100)
    assert job.params["sampling"]["max_tokens"] == 512 - job.prompt_tokens   # the job itself is not capped

    # The job ends after 3 tokens; the worker settles the charge when it records the usage.
    fake_worker.run(job.id, [("a b c", [5, 6, 7])])
    keys = RedisKeys.from_settings(settings)
    # Given back to the bucket (all of it, unless it has already refilled past it: 6.7 tokens/s).
    assert -97 <= settle_tokens(redis_client, keys, job.id, job.key_id, job.prompt_tokens + 3) < -50
    assert settle_tokens(redis_client, keys, job.id, job.key_id, job.prompt_tokens + 3) is None   # once only
    second = _post_job(client, key, max_tokens=10)
    assert _refilled_within(int(second.headers["x-ratelimit-remaining-tokens"]),
                            400 - (job.prompt_tokens + 3) - (job.prompt_tokens + 10), 400, time.monotonic() - began)


def test_tpm_overrun_is_charged_and_a_queued_cancel_gives_back(make_client, make_key, tenant, db_sessionmaker,
                                                               redis_client, settings):
    client = make_client(tpm_completion_estimate=10, tpm_burst_seconds=60)
    key = make_key(tenant, tpm=1000)
    began = time.monotonic()
    body = chat_body()
    del body["max_tokens"]
    first = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": body}, headers=auth(key))
    job = _jobs_of(db_sessionmaker, tenant)[0]
    charged = job.prompt_tokens + 10
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 1000 - charged
    # Used 50 tokens more than charged: the bucket is charged them.
    assert settle_tokens(redis_client, RedisKeys.from_settings(settings), job.id, job.key_id, charged + 50) == 50
    second = _post_job(client, key, max_tokens=5)
    second_charge = job.prompt_tokens + 5
    assert _refilled_within(int(second.headers["x-ratelimit-remaining-tokens"]),
                            1000 - charged - 50 - second_charge, 1000, time.monotonic() - began)
    # Cancelled while queued: nothing ran, the charge comes back at once.
    cancelled = client.post(f"/v1/jobs/{second.json()['id']}/cancel", headers=auth(key))
    assert cancelled.json()["status"] == "cancelled"
    third = _post_job(client, key, max_tokens=5)
    assert _refilled_within(int(third.headers["x-ratelimit-remaining-tokens"]),
                            1000 - charged - 50 - second_charge, 1000, time.monotonic() - began)


def test_explicit_max_tokens_is_charged_in_full(make_client, make_key, tenant, db_sessionmaker):
    client = make_client(tpm_burst_seconds=60)
    key = make_key(tenant, tpm=10_000)
    response = _post_job(client, key, max_tokens=300)
    prompt = _jobs_of(db_sessionmaker, tenant)[0].prompt_tokens
    assert int(response.headers["x-ratelimit-remaining-tokens"]) == 10_000 - prompt - 300


# -- the openai client and x-should-retry -----------------------------------------------------


def _sdk(client, key: str, requests: list[str]) -> openai.OpenAI:
    client.event_hooks = {"request": [lambda request: requests.append(f"{request.method} {request.url.path}")]}
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, max_retries=2, http_client=client)


def test_openai_client_does_not_retry_a_cancelled_job(client, make_key, tenant, db_sessionmaker):
    key = make_key(tenant)
    requests: list[str] = []
    sdk = _sdk(client, key, requests)
    outcome: dict = {}

    def call() -> None:
        try:
            sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not _jobs_of(db_sessionmaker, tenant) and time.monotonic() < deadline:
        time.sleep(0.05)
    job_id = _jobs_of(db_sessionmaker, tenant)[0].id
    client.event_hooks = {}
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key)).json()["status"] == "cancelled"
    thread.join(30)
    error = outcome["error"]
    assert isinstance(error, openai.ConflictError) and error.code == "cancelled"
    assert error.response.headers["x-should-retry"] == "false"
    assert error.response.headers["x-request-id"] == job_id
    assert error.request_id == job_id
    assert requests == ["POST /v1/chat/completions"]          # the SDK sent it once
    assert len(_jobs_of(db_sessionmaker, tenant)) == 1        # one job, never resubmitted


def test_openai_client_does_not_retry_a_request_too_large(client, make_key, tenant, db_sessionmaker):
    requests: list[str] = []
    sdk = _sdk(client, make_key(tenant, tpm=50), requests)
    with pytest.raises(openai.RateLimitError):
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=100)
    assert requests == ["POST /v1/chat/completions"]
    assert _jobs_of(db_sessionmaker, tenant) == []


# -- CORS -------------------------------------------------------------------------------------


PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_no_cors_by_default(client):
    response = client.get("/healthz", headers={"Origin": "https://app.example"})
    assert not [name for name in response.headers if name.startswith("access-control-")]
    assert client.options("/v1/chat/completions", headers=PREFLIGHT).status_code in (401, 405)


def test_cors_for_allowed_origins(make_client, make_key, tenant):
    client = make_client(allowed_origins="https://app.example")
    preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in preflight.headers
    # Another origin is not allowed.
    assert client.options("/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"}
                          ).status_code == 400
    # A simple request, an error included, carries the CORS headers and exposes rein's.
    response = client.get("/v1/jobs", headers={"Origin": "https://app.example"})
    assert response.status_code == 401
    assert response.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-request-id" in response.headers["access-control-expose-headers"]
    star = make_client(allowed_origins="*")
    assert star.get("/healthz", headers={"Origin": "https://any.example"}
                    ).headers["access-control-allow-origin"] == "*"

