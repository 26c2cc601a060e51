"""End to end: `rein api` and `rein worker` as subprocesses on a tiny model (see
e2e_support). Everything goes through HTTP (httpx) except what only the worker shows:
its heartbeat in Redis, read to see the engine's KV blocks freed after a cancel.

The SIGTERM test stops the worker, so it runs last (tests run in file order).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2e_support import (
    MODEL,
    STARTUP_TIMEOUT,
    Service,
    iter_events,
    read_events,
    result_text,
    run_service,
    submit,
)
from support import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    with run_service(tmp_path_factory.mktemp("e2e"), tiny_models("llama")) as svc:
        yield svc


# -- tests ------------------------------------------------------------------------------------


def test_tenant_isolation(service: Service) -> None:
    with service.client("a") as a, service.client("b") as b:
        job_id = submit(a, {"prompt": "isolation", "max_tokens": 4, "temperature": 0.0})
        assert b.get(f"/v1/jobs/{job_id}").status_code == 404
        assert b.get(f"/v1/jobs/{job_id}/events").status_code == 404
        assert b.post(f"/v1/jobs/{job_id}/cancel").status_code == 404
        assert job_id not in [j["id"] for j in b.get("/v1/jobs", params={"limit": 100}).json()["data"]]
        job = service.wait_job(a, job_id)
        assert job["status"] == "succeeded", job
        assert b.get(f"/v1/jobs/{job_id}").status_code == 404


def test_fifty_concurrent_jobs(service: Service) -> None:
    """50 jobs across two keys all succeed; streamed text equals the stored text; usage adds up."""
    clients = {t: service.client(t) for t in ("a", "b")}
    try:
        before = {t: _completion_tokens(c) for t, c in clients.items()}

        def body(i: int) -> tuple[str, str, dict]:
            tenant = "ab"[i % 2]
            sampling = {"temperature": 0.0} if i % 3 else {"temperature": 0.8, "top_p": 0.9, "seed": i}
            if i % 4 == 0:
                return tenant, "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": f"question number {i}"}],
                    "max_tokens": 8 + i % 9, **sampling}
            return tenant, "/v1/completions", {"prompt": f"Once upon a time {i}", "max_tokens": 8 + i % 9,
                                               **sampling}

        specs = [body(i) for i in range(50)]
        with ThreadPoolExecutor(max_workers=16) as pool:
            ids = list(pool.map(lambda s: submit(clients[s[0]], s[2], s[1]), specs))

        def check(i: int) -> tuple[str, int]:
            tenant, _, request = specs[i]
            client = clients[tenant]
            with client.stream("GET", f"/v1/jobs/{ids[i]}/events") as response:
                assert response.status_code == 200, response.read()
                events = read_events(response)
            job = service.wait_job(client, ids[i])
            assert job["status"] == "succeeded", job
            seqs = [seq for seq, _ in events]
            assert seqs == list(range(1, len(seqs) + 1)), f"job {ids[i]}: event ids {seqs}"
            assert events[-1][1]["finish_reason"] in ("stop", "length"), events[-1]
            streamed = "".join(data["text"] for _, data in events)
            assert streamed == result_text(job), f"job {ids[i]}: streamed {streamed!r} != stored"
            token_ids = [t for _, data in events for t in data.get("token_ids", [])]
            usage = job["usage"]
            assert usage["completion_tokens"] == len(token_ids) <= request["max_tokens"]
            assert events[-1][1]["usage"]["completion_tokens"] == usage["completion_tokens"]
            assert job["response"]["body"]["usage"]["completion_tokens"] == usage["completion_tokens"]
            return tenant, usage["completion_tokens"]

        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(check, range(50)))

        # Seeded and greedy jobs are reproducible: the same request gives the same text.
        for i in (1, 3):   # greedy completion, seeded completion
            tenant, endpoint, request = specs[i]
            again = service.wait_job(clients[tenant], submit(clients[tenant], request, endpoint))
            first = clients[tenant].get(f"/v1/jobs/{ids[i]}").json()
            assert result_text(again) == result_text(first), (request, result_text(again), result_text(first))
            before[tenant] += again["usage"]["completion_tokens"]

        for tenant, client in clients.items():
            generated = sum(n for t, n in results if t == tenant)
            assert generated > 0
            assert _completion_tokens(client) - before[tenant] == generated, tenant
    finally:
        for client in clients.values():
            client.close()


def _completion_tokens(client) -> int:
    report = client.get("/v1/usage").raise_for_status().json()
    return sum(bucket["completion_tokens"] for bucket in report["data"])


def test_resume_with_last_event_id(service: Service) -> None:
    """Disconnect after a few events, reconnect with Last-Event-ID: the rest, no gap, no repeat."""
    with service.client("a") as client:
        job_id = submit(client, {"prompt": "a long story", "max_tokens": 200, "temperature": 0.0,
                                 "ignore_eos": True})
        first: list[tuple[int, dict]] = []
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            assert response.status_code == 200
            for event in iter_events(response):
                first.append(event)
                if len(first) == 3:
                    break
        assert len(first) == 3 and first[-1][1].get("finish_reason") is None, first
        last_id = first[-1][0]
        with client.stream("GET", f"/v1/jobs/{job_id}/events",
                           headers={"Last-Event-ID": str(last_id)}) as response:
            assert response.status_code == 200
            rest = read_events(response)
        job = service.wait_job(client, job_id)
    assert job["status"] == "succeeded", job
    seqs = [seq for seq, _ in first + rest]
    assert seqs == list(range(1, len(seqs) + 1)), f"event ids not contiguous: {seqs}"
    assert rest[-1][1]["finish_reason"] == "length"
    assert "".join(data["text"] for _, data in first + rest) == result_text(job)
    token_ids = [t for _, data in first + rest for t in data.get("token_ids", [])]
    assert len(token_ids) == job["usage"]["completion_tokens"] == 200


def test_cancel_mid_generation_frees_blocks(service: Service) -> None:
    with service.client("b") as client:
        job_id = submit(client, {"prompt": "never ending", "max_tokens": 900, "temperature": 0.0,
                                 "ignore_eos": True})
        seen: list[tuple[int, dict]] = []
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for event in iter_events(response):
                seen.append(event)
                if len(seen) == 3:
                    break
        assert seen[-1][1].get("finish_reason") is None, "the job finished before it could be cancelled"
        cancelled_at = time.time()
        response = client.post(f"/v1/jobs/{job_id}/cancel")
        assert response.status_code == 200, response.text
        job = service.wait_job(client, job_id, timeout=30)
        assert job["status"] == "cancelled", job
        with client.stream("GET", f"/v1/jobs/{job_id}/events",
                           headers={"Last-Event-ID": str(seen[-1][0])}) as response:
            rest = read_events(response)
        assert rest and rest[-1][1]["finish_reason"] == "abort", rest[-3:]
        generated = len([t for _, data in seen + rest for t in data.get("token_ids", [])])
        assert generated < 900, f"the cancelled job generated all {generated} tokens"

    # The worker's heartbeat (every 5 s) after the cancel shows nothing running and every block free.
    def idle() -> dict | None:
        beat = service.heartbeat()
        if beat and beat["time"] > cancelled_at and beat["running"] == 0 and beat["waiting"] == 0 \
                and beat["kv_blocks_free"] == beat["kv_blocks"]:
            return beat
        return None

    try:
        wait_for(idle, 20, "a heartbeat with no running job and every KV block free", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last heartbeat: {service.heartbeat()}{service.diagnostics()}") from None


def test_sigterm_stops_worker_promptly(service: Service) -> None:
    """SIGTERM (warm shutdown) while a job runs: the worker exits within seconds and hands the
    job back; a new worker then finishes it, billed once, its stream still whole."""
    with service.client("a") as client:
        tokens_before = _completion_tokens(client)
        job_id = submit(client, {"prompt": "interrupted", "max_tokens": 900, "temperature": 0.0,
                                 "ignore_eos": True})
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for n, _ in enumerate(iter_events(response), 1):
                if n == 2:
                    break
        started = time.monotonic()
        service.worker.send_signal(signal.SIGTERM)
        try:
            code = service.worker.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        elapsed = time.monotonic() - started
        print(f"worker exited {elapsed:.2f} s after SIGTERM")
        assert code is not None and elapsed < 15, \
            f"worker took {elapsed:.1f} s to exit after SIGTERM (exit {code}){service.diagnostics()}"
        assert code == 0, f"worker exit code {code}{service.diagnostics()}"
        assert service.heartbeat() is None, "a warm shutdown removes the worker's heartbeat"
        job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
        assert job["status"] == "queued", f"the interrupted job was not handed back: {job}"

        # Another worker takes the handed-back job and finishes it.
        hostname = f"second-{service.hostname}"
        service.worker = service.spawn("worker2", "worker", "--model", MODEL, "--hostname", hostname)
        job = service.wait_job(client, job_id, timeout=STARTUP_TIMEOUT)
        assert job["status"] == "succeeded", job
        assert job["usage"]["completion_tokens"] == 900
        assert _completion_tokens(client) - tokens_before == 900, "the job was billed more than once"
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            events = read_events(response)
    seqs = [seq for seq, _ in events]
    assert seqs == list(range(1, len(seqs) + 1)), f"event ids not contiguous: {seqs[:20]}..."
    streamed = "".join(data["text"] for _, data in events)
    assert streamed == result_text(job), "the stream of a handed-back job does not match its result"
