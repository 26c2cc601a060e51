"""End to end (`rein api` + `rein worker` on a tiny model): a synchronous request whose client
disconnects has its job cancelled and its engine slot freed, billing the tokens made so far;
a follower of an async job may leave without cancelling it; the TPM charge of a request
without max_tokens is settled by the worker against the real usage. The API runs with
WEB_CONCURRENCY=2 in its environment, which must not break `rein api` (one process here)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
import pytest
from e2e_support import MAX_MODEL_LEN, MODEL, REIN, REPO, Service, run_service
from support import wait_for

from rein.jobs.ratelimit import tpm_charge_key
from rein.store.redis_keys import RedisKeys

pytestmark = pytest.mark.slow

TPM = 1_000_000
ESTIMATE = 64
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_MODEL_LEN - 32, "ignore_eos": True,
        "temperature": 0.0}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("conventions")
    env = {"REIN_DEFAULT_TPM": str(TPM), "REIN_TPM_COMPLETION_ESTIMATE": str(ESTIMATE),
           "REIN_TPM_BURST_SECONDS": "60", "WEB_CONCURRENCY": "2"}
    with run_service(tmp, tiny_models("llama"), extra_env=env) as svc:
        yield svc


@pytest.fixture(autouse=True)
def not_at_a_window_edge():
    if time.time() % 60 > 45:
        time.sleep(60 - time.time() % 60 + 0.1)


def _open_request(service: Service, tenant: str, path: str, body: dict) -> socket.socket:
    """A POST sent on a raw socket, so the test decides when the client goes away."""
    url = urlsplit(service.base_url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {service.keys[tenant]}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data)
    return sock


def _newest_job(client: httpx.Client) -> dict | None:
    jobs = client.get("/v1/jobs", params={"limit": 1}).raise_for_status().json()["data"]
    return jobs[0] if jobs else None


def _generating_job(service: Service, client: httpx.Client, after: set[str]) -> dict:
    """The tenant's new job, once its first tokens are out (on its event stream)."""
    keys = RedisKeys(service.env["REIN_REDIS_KEY_PREFIX"].rstrip(":"))

    def generating() -> dict | None:
        job = _newest_job(client)
        if job and job["id"] not in after and service.redis.xlen(keys.job_stream(job["id"])) >= 2:
            return job
        return None

    return wait_for(generating, 60, "the request's job to generate", interval=0.05)


def _known_jobs(client: httpx.Client) -> set[str]:
    return {job["id"] for job in client.get("/v1/jobs", params={"limit": 100}).json()["data"]}


def _assert_cancelled_soon(service: Service, client: httpx.Client, job_id: str, closed_at: datetime) -> dict:
    job = service.wait_job(client, job_id, timeout=30)
    assert job["status"] == "cancelled", f"{job}{service.diagnostics()}"
    finished = datetime.fromisoformat(job["timings"]["finished_at"])
    assert (finished - closed_at).total_seconds() < 5, job["timings"]
    usage = job["usage"]
    assert usage is not None and usage["prompt_tokens"] > 0
    assert 1 <= usage["completion_tokens"] < LONG["max_tokens"], usage   # billed what was made, no more
    # Its engine slot is free again (the heartbeat, every few seconds, shows nothing running).
    wait_for(lambda: (service.heartbeat() or {}).get("running") == 0, 20, "the engine to run nothing")
    return job


def test_sync_client_disconnect_cancels_the_job(service: Service) -> None:
    with service.client("a") as client:
        before = _known_jobs(client)
        sock = _open_request(service, "a", "/v1/completions", LONG)
        try:
            job = _generating_job(service, client, before)
        finally:
            closed_at = datetime.now(UTC)
            sock.close()
        _assert_cancelled_soon(service, client, job["id"], closed_at)
        assert "cancelled: its client disconnected" in (service.logs / "api.log").read_text()


def test_streaming_client_disconnect_cancels_the_job(service: Service) -> None:
    with service.client("a") as client:
        before = _known_jobs(client)
        sock = _open_request(service, "a", "/v1/chat/completions",
                             {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
                              "max_tokens": LONG["max_tokens"], "ignore_eos": True, "stream": True})
        try:
            received = b""
            while received.count(b"data: ") < 3:      # the response has started streaming
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
            assert b"x-request-id: job_" in received.lower()
            job = _generating_job(service, client, before)
        finally:
            closed_at = datetime.now(UTC)
            sock.close()
        _assert_cancelled_soon(service, client, job["id"], closed_at)


def test_async_job_outlives_its_follower(service: Service) -> None:
    with service.client("b") as client:
        created = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": {
            **LONG, "max_tokens": 48}})
        job_id = created.json()["id"]
        assert created.headers["x-request-id"] == job_id
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as events:
            for line in events.iter_lines():
                if line.startswith("data:"):
                    break            # one event, then the follower leaves
        job = service.wait_job(client, job_id)
        assert job["status"] == "succeeded" and job["usage"]["completion_tokens"] == 48


def _new_key(service: Service) -> str:
    """A key of its own (tenant a), so its TPM window holds only this test's requests."""
    done = subprocess.run([*REIN, "keys", "create", "--name", "tpm", "--tenant", "tpm-test", "--scopes", "inference"],
                          env=service.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_tpm_charge_is_settled_by_the_worker(service: Service) -> None:
    keys = RedisKeys(service.env["REIN_REDIS_KEY_PREFIX"].rstrip(":"))
    key = _new_key(service)
    with httpx.Client(base_url=service.base_url, timeout=180, headers={"Authorization": f"Bearer {key}"}) as client:
        # No max_tokens: charged prompt + REIN_TPM_COMPLETION_ESTIMATE, not the whole context.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count with me"}], "temperature": 0.0}
        first = client.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        job_id = first.headers["x-request-id"]
        usage = first.json()["usage"]
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == TPM - usage["prompt_tokens"] - ESTIMATE
        # The worker settles the charge when it records the job (the charge record is gone then).
        wait_for(lambda: not service.redis.exists(tpm_charge_key(keys, job_id)), 10, "the settlement")
        second = client.post("/v1/jobs", json={"endpoint": "/v1/chat/completions", "body": {**body, "max_tokens": 5}})
        assert second.status_code == 202
        # The bucket now lacks the first request's real usage and the second's charge, less
        # what it refilled meanwhile (TPM / 60 a second).
        remaining = int(second.headers["x-ratelimit-remaining-tokens"])
        assert TPM - usage["total_tokens"] - (usage["prompt_tokens"] + 5) <= remaining <= TPM - (
            usage["prompt_tokens"] + 5)
