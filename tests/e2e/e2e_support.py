"""The end-to-end service harness: `rein api` (uvicorn) and `rein worker` (Celery) as
subprocesses on a tiny model, for the e2e test modules.

`run_service(tmp, model_dir)` gives a fresh database `rein_e2e_<random>` (migrated with
`rein migrate`, dropped at the end, pass or fail), a fresh Redis key prefix
`rein_e2e_<random>:` (its keys deleted at the end), two API keys for tenants "a" and "b",
the API on a free port and one worker. A test module wraps it in a module-scoped fixture.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from support import connect_postgres, delete_prefixed, free_port, unreachable, wait_for

from rein.store.redis_client import redis_client as make_redis_client
from rein.store.redis_keys import RedisKeys

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
    workers: list[subprocess.Popen] = field(default_factory=list)   # all of them, `worker` first
    database_url: str = ""

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


@contextmanager
def run_service(tmp: Path, model_dir: Path, *, scopes: str = "inference,usage",
                extra_env: dict[str, str] | None = None, postgres_url: str = POSTGRES_URL,
                redis_url: str = REDIS_URL, workers: int = 1, model_name: str = MODEL,
                max_model_len: int = MAX_MODEL_LEN) -> Iterator[Service]:
    """Migrate a fresh database, start the API and `workers` workers, create keys for tenants
    a and b.

    `scopes` are the keys' scopes; `extra_env` adds or overrides REIN_* settings of all the
    processes; `postgres_url` (a server's maintenance database) and `redis_url` choose the
    servers (the fault tests start their own). `model_dir` is served as `model_name` with
    `max_model_len` (a directory or a GGUF file; the real-model tier serves a GGUF file).
    Everything is stopped and dropped on exit, pass or fail.
    """
    import psycopg
    import redis
    from psycopg import sql

    from rein.store.db import database_url, server_location

    server = database_url(postgres_url)    # several hosts allowed (test_failover.py)
    try:
        connect_postgres(server).close()
    except psycopg.OperationalError as exc:
        unreachable(f"PostgreSQL at {server_location(server)}", exc)
    # rein's own client maker: a Sentinel URL (test_failover.py) works here as in the service.
    redis_client = make_redis_client(redis_url, socket_connect_timeout=5)
    try:
        redis_client.ping()
    except redis.RedisError as exc:
        unreachable(f"Redis at {redis_url}", exc)

    t0 = time.monotonic()
    run_id = secrets.token_hex(4)
    dbname = f"rein_e2e_{run_id}"
    prefix = f"rein_e2e_{run_id}:"
    t_model = time.monotonic()
    port = free_port()
    hostname = f"e2e-{run_id}@localhost"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")} | {
        "REIN_DATABASE_URL": server.set(database=dbname).render_as_string(hide_password=False),
        "REIN_REDIS_URL": redis_url,
        "REIN_REDIS_KEY_PREFIX": prefix,
        "REIN_MODELS": f"{model_name}={model_dir}@{max_model_len}",
        "REIN_KV_CACHE_MEMORY": "32MiB",
        "REIN_API_HOST": "127.0.0.1",
        "REIN_API_PORT": str(port),
        "REIN_MAX_NUM_SEQS": "16",
        "REIN_DEVICE": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    } | (extra_env or {})
    procs: list[subprocess.Popen] = []
    logs: list = []

    def spawn(name: str, *args: str, cwd: Path = REPO, env_update: dict[str, str] | None = None) -> subprocess.Popen:
        """`rein *args` logging to tmp/name.log, stopped at the end; `cwd` and `env_update` (over
        the service's env) make another replica of a process (tests/e2e/test_api_replicas.py)."""
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed at teardown)
        logs.append(log)
        proc = subprocess.Popen([*REIN, *args], env=env | (env_update or {}), cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    def cli(*args: str) -> str:
        done = subprocess.run([*REIN, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"rein {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
        return done.stdout

    try:
        cli("migrate")   # creates the database (it does not exist yet) and upgrades it
        t_migrate = time.monotonic()
        worker_procs = [spawn("worker", "worker", "--model", model_name, "--hostname", hostname, "--loglevel", "info")]
        for n in range(1, workers):
            worker_procs.append(spawn(f"worker{n}", "worker", "--model", model_name, "--hostname",
                                      f"e2e-{run_id}-{n}@localhost", "--loglevel", "info"))
        worker = worker_procs[0]
        api = spawn("api", "api")

        def create_key(tenant: str) -> tuple[str, str]:
            out = cli("keys", "create", "--name", tenant, "--tenant", f"e2e-{run_id}-{tenant}",
                      "--scopes", scopes)
            return tenant, out.strip().splitlines()[-1].strip()   # the key, alone on the last line

        with ThreadPoolExecutor(max_workers=2) as pool:   # while the api and the worker start
            keys = dict(pool.map(create_key, ("a", "b")))
        svc = Service(base_url=f"http://127.0.0.1:{port}", keys=keys, env=env, redis=redis_client,
                      heartbeat_key=RedisKeys(prefix.rstrip(":")).worker_heartbeat(hostname), worker=worker, api=api,
                      logs=tmp, spawn=spawn, hostname=hostname, workers=worker_procs,
                      database_url=env["REIN_DATABASE_URL"])
        beats = [RedisKeys(prefix.rstrip(":")).worker_heartbeat(hostname if n == 0 else f"e2e-{run_id}-{n}@localhost")
                 for n in range(workers)]

        def ready() -> bool:
            for proc in (*worker_procs, api):
                if proc.poll() is not None:
                    raise AssertionError(f"a service process exited early{svc.diagnostics()}")
            try:
                api_ok = httpx.get(f"{svc.base_url}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                api_ok = False
            return api_ok and all(redis_client.exists(beat) for beat in beats)

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
