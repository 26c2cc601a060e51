"""End to end: `rein api` (uvicorn) and `rein worker` (Celery) as subprocesses on a tiny model.

One module-scoped service: a fresh database `rein_e2e_<random>` (migrated with `rein migrate`,
dropped at the end, pass or fail), a fresh Redis key prefix `rein_e2e_<random>:` (its keys
deleted at the end), two API keys for two tenants, the API on a free port and one worker.
Everything goes through HTTP (httpx) except what only the worker shows: its heartbeat in
Redis, read to see the engine's KV blocks freed after a cancel.

The SIGTERM test stops the worker, so it runs last (tests run in file order).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support import connect_postgres, delete_prefixed, unreachable, wait_for

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

POSTGRES_URL = os.environ.get("REIN_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MODEL = "tiny"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT = 150.0  # api and worker import torch/transformers; the machine may be busy
JOB_TIMEOUT = 90.0
REPO = Path(__file__).resolve().parents[2]
REIN = [sys.executable, "-m", "rein.cli.main"]


# -- helpers ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def read_events(response) -> list[tuple[int, dict]]:
    """(id, data) of each SSE event of an open streaming response, until the final one."""
    events: list[tuple[int, dict]] = []
    for event_id, data in iter_events(response):
        events.append((event_id, data))
        if data.get("finish_reason") is not None or data.get("error") is not None:
            break
    return events


def iter_events(response) -> Iterator[tuple[int, dict]]:
    event_id: int | None = None
    data: list[str] = []
    for line in response.iter_lines():
        if line.startswith("id:"):
            event_id = int(line[3:].strip())
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line == "":
            if data:
                assert event_id is not None, f"SSE event without an id: {data}"
                yield event_id, json.loads("\n".join(data))
            event_id, data = None, []


def result_text(job: dict) -> str:
    choice = job["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@dataclass
class Service:
    base_url: str
    keys: dict[str, str]          # tenant -> API key
    env: dict[str, str]
    redis: object                 # redis.Redis on the test Redis
    heartbeat_key: str
    worker: subprocess.Popen
    api: subprocess.Popen
    logs: Path
    spawn: Callable[..., subprocess.Popen]
    hostname: str

    def client(self, tenant: str, timeout: float = 30.0):
        return httpx.Client(base_url=self.base_url, timeout=timeout,
                            headers={"Authorization": f"Bearer {self.keys[tenant]}"})

    def diagnostics(self) -> str:
        return (f"\n--- worker log (exit {self.worker.poll()}) ---\n{_tail(self.logs / 'worker.log')}"
                f"\n--- api log (exit {self.api.poll()}) ---\n{_tail(self.logs / 'api.log')}")

    def heartbeat(self) -> dict | None:
        raw = self.redis.get(self.heartbeat_key)
        return json.loads(raw) if raw else None

    def wait_job(self, client, job_id: str, timeout: float = JOB_TIMEOUT) -> dict:
        def done() -> dict | None:
            job = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        try:
            return wait_for(done, timeout, f"job {job_id} to finish", interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}{self.diagnostics()}") from None


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- the service ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    import psycopg
    import redis
    from psycopg import sql
    from sqlalchemy.engine import make_url

    server = make_url(POSTGRES_URL)
    try:
        connect_postgres(server).close()
    except psycopg.OperationalError as exc:
        unreachable(f"PostgreSQL at {server.host}:{server.port or 5432}", exc)
    redis_client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        redis_client.ping()
    except redis.RedisError as exc:
        unreachable(f"Redis at {REDIS_URL}", exc)

    t0 = time.monotonic()
    run_id = secrets.token_hex(4)
    dbname = f"rein_e2e_{run_id}"
    prefix = f"rein_e2e_{run_id}:"
    tmp = tmp_path_factory.mktemp("e2e")
    model_dir = tiny_models("llama")   # shared with the rest of the session (tests/conftest.py)
    t_model = time.monotonic()
    port = _free_port()
    hostname = f"e2e-{run_id}@localhost"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")} | {
        "REIN_DATABASE_URL": server.set(database=dbname).render_as_string(hide_password=False),
        "REIN_REDIS_URL": REDIS_URL,
        "REIN_REDIS_KEY_PREFIX": prefix,
        "REIN_MODELS": f"{MODEL}={model_dir}@{MAX_MODEL_LEN}",
        "REIN_KV_CACHE_MEMORY": "32MiB",
        "REIN_API_HOST": "127.0.0.1",
        "REIN_API_PORT": str(port),
        "REIN_MAX_NUM_SEQS": "16",
        "REIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen] = []
    logs: list = []

    def spawn(name: str, *args: str) -> subprocess.Popen:
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed at teardown)
        logs.append(log)
        proc = subprocess.Popen([*REIN, *args], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def cli(*args: str) -> str:
        done = subprocess.run([*REIN, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"rein {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        return done.stdout

    try:
        cli("migrate")   # creates the database (it does not exist yet) and upgrades it
        t_migrate = time.monotonic()
        worker = spawn("worker", "worker", "--model", MODEL, "--hostname", hostname, "--loglevel", "info")
        api = spawn("api", "api")

        def create_key(tenant: str) -> tuple[str, str]:
            out = cli("keys", "create", "--name", tenant, "--tenant", f"e2e-{run_id}-{tenant}",
                      "--scopes", "inference,usage")
            return tenant, out.strip().splitlines()[-1].strip()   # the key, alone on the last line

        with ThreadPoolExecutor(max_workers=2) as pool:   # while the api and the worker start
            keys = dict(pool.map(create_key, ("a", "b")))
        svc = Service(base_url=f"http://127.0.0.1:{port}", keys=keys, env=env, redis=redis_client,
                      heartbeat_key=f"{prefix.rstrip(':')}:worker:{hostname}", worker=worker, api=api,
                      logs=tmp, spawn=spawn, hostname=hostname)

        def ready() -> bool:
            for proc in (worker, api):
                if proc.poll() is not None:
                    raise AssertionError(f"a service process exited early{svc.diagnostics()}")
            try:
                api_ok = httpx.get(f"{svc.base_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                api_ok = False
            return api_ok and svc.heartbeat() is not None

        try:
            wait_for(ready, STARTUP_TIMEOUT, "/readyz and the worker's heartbeat", interval=0.25)
        except AssertionError as exc:
            raise AssertionError(f"{exc}{svc.diagnostics()}") from None
        t_ready = time.monotonic()
        print(f"\ne2e setup: tiny model {t_model - t0:.1f} s, migrate {t_migrate - t_model:.1f} s, "
              f"api + worker ready {t_ready - t_migrate:.1f} s")
        yield svc
    finally:
        for proc in procs:
            _stop(proc)
        for log in logs:
            log.close()
        try:
            delete_prefixed(redis_client, prefix)
        finally:
            redis_client.close()
            with connect_postgres(server) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


def submit(client, body: dict, endpoint: str = "/v1/completions") -> str:
    response = client.post("/v1/jobs", json={"endpoint": endpoint, "body": {"model": MODEL, **body}})
    assert response.status_code == 202, response.text
    return response.json()["id"]


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
