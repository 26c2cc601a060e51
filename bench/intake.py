"""Intake and stream latency: the API's POST /v1/jobs beside raw Celery sends, and XADD → SSE.

    python bench/intake.py [--jobs 1000] [--concurrency 16] [--rounds 2] [--events 300]
                           [--interval-ms 2] [--api-workers 1] [--redis-url URL] [--postgres-url URL]

Everything runs on loopback, in a throwaway Postgres database `rein_bench_<random>` (migrated
with rein.store.migrate.upgrade, dropped at the end even on failure) and under a unique Redis
key prefix `rein_bench_<random>:` (every key under it deleted at the end), so it shares the
servers with anything else safely. No worker runs: accepted jobs just wait in their queue
until the prefix is deleted.

* API intake: `rein api` (uvicorn, as deployed) in a subprocess on a free port, serving the
  tiny llama (.cache/bench-models/llama-tiny, built with rein.fixtures.tiny_model.make_tiny_model if
  missing) for its tokenizer, REIN_MAX_QUEUE_DEPTH=100000 so backpressure never answers.
  `--jobs` POST /v1/jobs (a small /v1/completions body) over `--concurrency` keep-alive
  connections at once (a minimal asyncio HTTP/1.1 client, see post_jobs): jobs/s = jobs /
  wall seconds, and each request's latency (p50/p99) as the client sees it. Each accepted
  job costs the API: auth (key lookup, cached for a second), tokenization, then its share of
  a group commit (rein.api.intake: one Lua call for the queue-depth check and the rate
  limits, one multi-row INSERT, one pipelined publish of the Celery messages).
* Raw Celery: the same number of `enqueue_job(make_celery(settings), JobMessage)` calls:
  Celery's `send_task` (apply_async by name) to the model's queue at the job's priority, one
  message per call, the message built from the same body with the same parser, from
  `--concurrency` threads, on the same Redis. The API sends the same Celery messages
  (a test compares them) but a group at a time (rein.jobs.queues.enqueue_jobs).
  Printed as msgs/s, with per-call latency, and the ratio API jobs/s ÷ raw msgs/s.
  Rounds alternate API and raw (after a warm-up of each); the figures are the medians of the
  rounds, so a burst of load from a neighbour on the machine moves both sides alike.
* Stream latency: a job created through POST /v1/jobs; an SSE client follows
  GET /v1/jobs/{id}/events while a thread plays the worker with the worker's real code,
  rein.worker.publisher.TokenPublisher.publish_step (one EVALSHA of its script: XADD id
  `<seq>-0` + PUBLISH [+ EXPIRE]; sent on the calling thread, as without the worker's sender
  thread) with one RequestOutput per step, `--events` steps `--interval-ms`
  apart, then the final one. The send time of each seq is taken just before publish_step
  (so the Redis round trip of the worker's send counts); the receive time when the
  client has read the event's `data:` line. One warm-up event first makes sure the client
  is already blocked in the API's XREAD when the timed events start. Both ends are in this
  process on one monotonic clock.

CPU: for each round, the CPU time used per job by the API processes, Postgres, Redis and
this process (the HTTP clients; the sending threads in a raw round), from /proc. The rates
depend on how many cores are free; the CPU per job says what each job costs wherever it runs.

Targets (issue 3): API intake ≥ 0.5× raw send rate; stream latency p99 < 10 ms on loopback.
The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / ".cache" / "bench-models" / "llama-tiny"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
ENDPOINT = "/v1/completions"
BODY = {"model": MODEL_NAME, "prompt": "Write one short sentence about queues.", "max_tokens": 16}
WARMUP = 50
SERIAL = 100

TARGET_RATIO = 0.5
TARGET_STREAM_P99_MS = 10.0


# -- small helpers ----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ensure_model(preset: str = "tiny") -> Path:
    """The bench's random-weight llama of this preset (built once under .cache/bench-models)."""
    from rein.fixtures.tiny_model import ensure_tiny_model

    return ensure_tiny_model(MODEL_DIR.with_name(f"llama-{preset}"), arch="llama", seed=0, preset=preset)


def check_loopback(url: str, what: str) -> None:
    from urllib.parse import urlparse

    from sqlalchemy.engine import make_url

    host = make_url(url).host if what == "postgres" else urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        sys.exit(f"error: {what} must be on loopback for this benchmark, got host {host!r}")


# -- CPU accounting (Linux /proc) ---------------------------------------------------------------


def _proc_cpu_seconds(pid: str) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def cpu_by_role(api_pid: int) -> dict[str, float]:
    """CPU seconds used so far by: the API process and its children, Postgres, Redis, and
    this process (the HTTP clients or the raw-send threads). Postgres backends come and go,
    so compare two readings only across a window in which no connection closed."""
    me = str(os.getpid())
    parents: dict[str, str] = {}
    commands: dict[str, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parents[entry.name] = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            commands[entry.name] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    api = {str(api_pid)}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in api and pid not in api:
                api.add(pid)
                grew = True
    totals = {"api": 0.0, "postgres": 0.0, "redis": 0.0, "bench": 0.0}
    for pid, command in commands.items():
        role = ("api" if pid in api else "bench" if pid == me else "postgres" if command.startswith("postgres")
                else "redis" if "redis-server" in command else None)
        if role is not None:
            try:
                totals[role] += _proc_cpu_seconds(pid)
            except OSError:
                pass
    return totals


def cpu_ms_per_item(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {role: round((after[role] - before[role]) * 1000 / n, 3) for role in before}


# -- throwaway database and Redis prefix ------------------------------------------------------


class Sandbox:
    """A fresh database and Redis key prefix; `close()` drops and deletes them."""

    def __init__(self, postgres_url: str, redis_url: str) -> None:
        from sqlalchemy.engine import make_url

        self.tag = secrets.token_hex(4)
        self.db_name = f"rein_bench_{self.tag}"
        self.server_url = make_url(postgres_url)
        self.database_url = self.server_url.set(database=self.db_name).render_as_string(hide_password=False)
        self.redis_url = redis_url
        self.prefix = f"rein_bench_{self.tag}:"
        self.created = False

    def _admin(self):
        import psycopg

        from rein.store.db import psycopg_conninfo

        return psycopg.connect(autocommit=True, connect_timeout=5, **psycopg_conninfo(self.server_url))

    def migrate(self):
        from rein.core.settings import Settings
        from rein.store.migrate import upgrade

        self.created = True   # from here on, drop it whatever happens
        return upgrade(Settings(database_url=self.database_url))

    def delete_keys(self) -> int:
        import redis

        client = redis.Redis.from_url(self.redis_url)
        deleted = 0
        try:
            pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self.prefix) + "*"
            batch: list[bytes] = []
            for key in client.scan_iter(match=pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    deleted += client.delete(*batch)
                    batch.clear()
            if batch:
                deleted += client.delete(*batch)
        finally:
            client.close()
        return deleted

    def drop_database(self) -> None:
        if not self.created:
            return
        from psycopg import sql

        with self._admin() as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.db_name)))


# -- the API process --------------------------------------------------------------------------


class ApiProcess:
    def __init__(self, sandbox: Sandbox, model_dir: Path, log_path: Path, workers: int = 1) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")}
        env.update({
            "REIN_DATABASE_URL": sandbox.database_url,
            "REIN_REDIS_URL": sandbox.redis_url,
            "REIN_REDIS_KEY_PREFIX": sandbox.prefix,
            "REIN_MODELS": f"{MODEL_NAME}={model_dir}@{MAX_MODEL_LEN}",
            "REIN_MAX_QUEUE_DEPTH": "100000",
            "REIN_API_HOST": "127.0.0.1",
            "REIN_API_PORT": str(self.port),
            "REIN_API_WORKERS": str(workers),
        })
        rein = Path(sys.executable).with_name("rein")
        command = [str(rein), "api"] if rein.is_file() else [sys.executable, "-m", "rein.cli.main", "api"]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rein api exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"rein api not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


# -- intake -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    count: int
    wall_s: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.count / self.wall_s

    @property
    def p50(self) -> float:
        return pct(self.latencies_ms, 50)

    @property
    def p99(self) -> float:
        return pct(self.latencies_ms, 99)


async def post_jobs(base_url: str, key: str, n: int, concurrency: int) -> tuple[Run, list[str]]:
    """n POST /v1/jobs over `concurrency` keep-alive connections; every answer must be 202.

    The client is a minimal HTTP/1.1 writer/reader on asyncio streams (the request bytes are
    built once), like a load generator: httpx costs about as much CPU per request as the API
    itself, and on a small machine that CPU would be taken from the server being measured.
    """
    from urllib.parse import urlparse

    url = urlparse(base_url)
    payload = json.dumps({"endpoint": ENDPOINT, "body": BODY}).encode()
    request = (f"POST /v1/jobs HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode() + payload
    latencies: list[float] = []
    ids: list[str] = []
    remaining = n

    async def one_connection() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        try:
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                body = await reader.readexactly(length)
                latencies.append((time.perf_counter() - t0) * 1000)
                status = int(head.split(b" ", 2)[1])
                if status != 202:
                    raise RuntimeError(f"POST /v1/jobs answered {status}: {body[:300]!r}")
                ids.append(json.loads(body)["id"])
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(one_connection() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return Run(n, wall, latencies), ids


def raw_sends(app, message_for, n: int, concurrency: int) -> Run:
    """n enqueue_job calls (Celery send_task, one message each) from `concurrency` threads."""
    from rein.jobs.queues import enqueue_job

    latencies: list[float] = []
    lock = threading.Lock()
    remaining = [n]

    def worker() -> None:
        while True:
            with lock:
                if remaining[0] <= 0:
                    return
                remaining[0] -= 1
            message = message_for()
            t0 = time.perf_counter()
            enqueue_job(app, message)
            latencies.append((time.perf_counter() - t0) * 1000)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        start = time.perf_counter()
        futures = [pool.submit(worker) for _ in range(concurrency)]
        for future in futures:
            future.result()
        wall = time.perf_counter() - start
    return Run(n, wall, latencies)


def raw_message_factory(model_dir: Path, tenant: str, key_id: str):
    """Builds the JobMessage the API would send for BODY (same parser, same tokenizer)."""
    from rein.core.priorities import PRIORITY_INTERACTIVE
    from rein.core.settings import ServedModel
    from rein.jobs.registry import load_model
    from rein.openai.request import parse_request
    from rein.store.messages import JobMessage
    from rein.store.tables import new_job_id

    entry = load_model(ServedModel(name=MODEL_NAME, source=str(model_dir), max_model_len=MAX_MODEL_LEN))
    parsed = parse_request(ENDPOINT, dict(BODY), entry.tokenizer, entry.max_model_len)
    sampling = dataclasses.asdict(parsed.params)

    def make() -> JobMessage:
        return JobMessage(job_id=new_job_id(), model=MODEL_NAME, endpoint=ENDPOINT,
                          prompt_token_ids=list(parsed.prompt_token_ids), sampling=dict(sampling),
                          priority=PRIORITY_INTERACTIVE, logprobs_mode=parsed.logprobs_mode,
                          tenant=tenant, key_id=key_id)

    return make


# -- stream latency ---------------------------------------------------------------------------


async def stream_latency(base_url: str, key: str, job_id: str, settings, events: int,
                         interval_s: float) -> dict:
    import httpx
    import redis

    from rein.engine.step_outputs import RequestOutput
    from rein.store.redis_keys import RedisKeys
    from rein.worker.publisher import TokenPublisher

    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    connected = threading.Event()
    failure: list[BaseException] = []
    client_redis = redis.Redis.from_url(settings.redis_url)
    publisher = TokenPublisher(client_redis, RedisKeys.from_settings(settings), settings.stream_maxlen,
                               settings.stream_ttl_seconds, settings.job_timeout_seconds)
    final_seq = events + 2

    def worker_side() -> None:
        try:
            publisher.begin(job_id)
            publisher.publish_step([RequestOutput(job_id, [7], "w")])            # seq 1: warm-up
            if not connected.wait(15):
                raise RuntimeError("the SSE client did not receive the warm-up event")
            time.sleep(0.05)     # let the API settle back into its blocking XREAD
            start = time.perf_counter()
            for i in range(events + 1):
                target = start + (i + 1) * interval_s
                delay = target - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                seq = i + 2
                final = seq == final_seq
                output = RequestOutput(job_id, [11 + i % 100], "x", finished=final,
                                       finish_reason="length" if final else None,
                                       num_prompt_tokens=8, num_output_tokens=events + 1 if final else 0)
                sent[seq] = time.perf_counter()
                publisher.publish_step([output])
        except BaseException as exc:  # reported by the client side
            failure.append(exc)

    thread = threading.Thread(target=worker_side, name="fake-worker", daemon=True)
    headers = {"Authorization": f"Bearer {key}", "Accept": "text/event-stream"}
    pipelines_before = publisher.pipelines_sent
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None) as client:
        thread.start()
        async with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            if response.status_code != 200:
                raise RuntimeError(f"GET events answered {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                data = json.loads(line[5:])
                seq = data["seq"]
                received[seq] = now
                if seq == 1:
                    connected.set()
                if data.get("finish_reason") is not None or data.get("error") is not None:
                    break
    await asyncio.to_thread(thread.join, 10)
    client_redis.close()
    if failure:
        raise RuntimeError(f"the fake worker failed: {failure[0]!r}")
    latencies = [(received[s] - sent[s]) * 1000 for s in sorted(sent) if s in received]
    missing = [s for s in sorted(sent) if s not in received]
    if missing:
        raise RuntimeError(f"{len(missing)} events never reached the SSE client (first: {missing[:5]})")
    return {"events": len(latencies), "p50": pct(latencies, 50), "p99": pct(latencies, 99),
            "max": max(latencies), "mean": statistics.fmean(latencies),
            "pipelines": publisher.pipelines_sent - pipelines_before}


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000, help="jobs per round, each side (default 1000)")
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients / threads (16)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating API/raw rounds (default 2)")
    parser.add_argument("--events", type=int, default=300, help="timed stream events (default 300)")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="spacing of stream events (2 ms)")
    parser.add_argument("--api-workers", type=int, default=1,
                        help="API processes (REIN_API_WORKERS; default 1)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
                        help="the Postgres server (its maintenance database); the bench database is made on it")
    args = parser.parse_args()
    check_loopback(args.redis_url, "redis")
    check_loopback(args.postgres_url, "postgres")
    sys.setswitchinterval(0.0005)   # two threads in this process (fake worker, SSE client)

    t_start = time.monotonic()
    load_before = os.getloadavg()[0]

    def phase(text: str) -> None:
        print(f"[{time.monotonic() - t_start:6.1f} s] {text}", file=sys.stderr, flush=True)

    model_dir = ensure_model()
    sandbox = Sandbox(args.postgres_url, args.redis_url)
    api: ApiProcess | None = None
    log_dir = Path(tempfile.mkdtemp(prefix="rein-bench-intake-"))
    celery_app = None
    try:
        from sqlalchemy.orm import sessionmaker
        from sqlalchemy.pool import NullPool

        from rein.core.settings import Settings
        from rein.jobs.queues import make_celery, queue_keys
        from rein.store.db import make_engine
        from rein.store.keys import create_key

        report = sandbox.migrate()
        phase(f"database {sandbox.db_name}: migrated to {report.after}; redis prefix {sandbox.prefix!r}")
        engine = make_engine(sandbox.database_url, poolclass=NullPool)
        try:
            with sessionmaker(engine).begin() as session:
                created = create_key(session, name="bench-intake", tenant="bench", scopes="inference")
        finally:
            engine.dispose()
        key = created.key
        settings = Settings(database_url=sandbox.database_url, redis_url=sandbox.redis_url,
                            redis_key_prefix=sandbox.prefix, models=f"{MODEL_NAME}={model_dir}@{MAX_MODEL_LEN}",
                            max_queue_depth=100_000)

        api = ApiProcess(sandbox, model_dir, log_dir / "api.log", workers=args.api_workers)
        api.wait_ready()
        phase(f"rein api ready on {api.base_url} (pid {api.proc.pid})")

        celery_app = make_celery(settings)
        message_for = raw_message_factory(model_dir, created.info.tenant, created.info.key_id)

        phase("raw Celery app and message ready")
        # warm-up: connections, pools, the queue's binding, the tokenizer's caches
        _, warm_ids = asyncio.run(post_jobs(api.base_url, key, WARMUP, args.concurrency))
        raw_sends(celery_app, message_for, WARMUP, args.concurrency)

        api_runs: list[Run] = []
        raw_runs: list[Run] = []
        api_cpu: list[dict[str, float]] = []
        raw_cpu: list[dict[str, float]] = []
        for r in range(args.rounds):
            before = cpu_by_role(api.proc.pid)
            run, _ = asyncio.run(post_jobs(api.base_url, key, args.jobs, args.concurrency))
            api_cpu.append(cpu_ms_per_item(before, cpu_by_role(api.proc.pid), args.jobs))
            api_runs.append(run)
            before = cpu_by_role(api.proc.pid)
            raw_runs.append(raw_sends(celery_app, message_for, args.jobs, args.concurrency))
            raw_cpu.append(cpu_ms_per_item(before, cpu_by_role(api.proc.pid), args.jobs))
            phase(f"round {r + 1}: api {api_runs[-1].rate:8.1f} jobs/s   raw {raw_runs[-1].rate:8.1f} msgs/s")

        # one client at a time: each request's own cost, with no queueing behind others
        serial_api, _ = asyncio.run(post_jobs(api.base_url, key, SERIAL, 1))
        serial_raw = raw_sends(celery_app, message_for, SERIAL, 1)
        phase(f"serial: api p50 {serial_api.p50:.2f} ms, raw p50 {serial_raw.p50:.2f} ms")

        import redis as redis_lib

        client = redis_lib.Redis.from_url(sandbox.redis_url)
        pipe = client.pipeline(transaction=False)
        for queue_key in queue_keys(settings, MODEL_NAME):
            pipe.llen(queue_key)
        queued = sum(pipe.execute())
        client.close()
        expected_queued = 2 * WARMUP + 2 * SERIAL + 2 * args.rounds * args.jobs

        stream = asyncio.run(stream_latency(api.base_url, key, warm_ids[0], settings, args.events,
                                            args.interval_ms / 1000))
        phase(f"stream: {stream['events']} events")
    finally:
        if celery_app is not None:
            celery_app.close()
        if api is not None:
            api.stop()
        cleanup_errors = []
        try:
            deleted = sandbox.delete_keys()
        except Exception as exc:
            cleanup_errors.append(f"redis keys under {sandbox.prefix!r}: {exc}")
            deleted = -1
        try:
            sandbox.drop_database()
        except Exception as exc:
            cleanup_errors.append(f"database {sandbox.db_name}: {exc}")
        for error in cleanup_errors:
            print(f"warning: cleanup failed: {error}", file=sys.stderr)
        if not cleanup_errors:
            phase(f"cleaned up: database {sandbox.db_name} dropped, {deleted} redis keys deleted")

    def median_cpu(rounds: list[dict[str, float]]) -> dict[str, float]:
        return {role: round(statistics.median(r[role] for r in rounds), 3) for role in rounds[0]}

    cpu_api, cpu_raw = median_cpu(api_cpu), median_cpu(raw_cpu)
    api_rate = statistics.median(r.rate for r in api_runs)
    raw_rate = statistics.median(r.rate for r in raw_runs)
    api_lat = [x for r in api_runs for x in r.latencies_ms]
    raw_lat = [x for r in raw_runs for x in r.latencies_ms]
    ratio = api_rate / raw_rate
    ratio_ok = ratio >= TARGET_RATIO
    stream_ok = stream["p99"] < TARGET_STREAM_P99_MS

    print()
    print(f"intake: {args.rounds} rounds x {args.jobs} jobs per side, {args.concurrency} concurrent, "
          f"loopback, {args.api_workers} API process(es); median of rounds ({os.cpu_count()} CPUs, 1-min load average "
          f"{load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end)")
    print(f"  {'path':<34} {'rate/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"  {'API POST /v1/jobs (202)':<34} {api_rate:>9.1f} {pct(api_lat, 50):>8.2f} {pct(api_lat, 99):>8.2f}")
    print(f"  {'raw Celery send (enqueue_job)':<34} {raw_rate:>9.1f} {pct(raw_lat, 50):>8.2f} {pct(raw_lat, 99):>8.2f}")
    print(f"  {'API, 1 client (serial)':<34} {serial_api.rate:>9.1f} {serial_api.p50:>8.2f} {serial_api.p99:>8.2f}")
    print(f"  {'raw, 1 thread (serial)':<34} {serial_raw.rate:>9.1f} {serial_raw.p50:>8.2f} {serial_raw.p99:>8.2f}")
    print(f"  ratio API / raw: {ratio:.3f}x   (queued messages seen in Redis: {queued}, expected {expected_queued})")
    print("  CPU ms per job (median of rounds): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu_api.items())
          + "  |  per raw send: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu_raw.items()))
    print(f"stream: {stream['events']} events {args.interval_ms:g} ms apart, publish_step → SSE data line")
    print(f"  p50 {stream['p50']:.3f} ms   p99 {stream['p99']:.3f} ms   max {stream['max']:.3f} ms   "
          f"mean {stream['mean']:.3f} ms")
    print("targets:")
    print(f"  API intake >= {TARGET_RATIO}x raw send    {ratio:.3f}x      {'PASS' if ratio_ok else 'MISS'}")
    print(f"  stream p99 < {TARGET_STREAM_P99_MS:g} ms          {stream['p99']:.3f} ms  {'PASS' if stream_ok else 'MISS'}")
    result = {
        "bench": "intake",
        "jobs_per_round": args.jobs, "rounds": args.rounds, "concurrency": args.concurrency,
        "api_workers": args.api_workers,
        "cpus": os.cpu_count(), "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "api_jobs_per_s": round(api_rate, 1),
        "api_p50_ms": round(pct(api_lat, 50), 3), "api_p99_ms": round(pct(api_lat, 99), 3),
        "raw_msgs_per_s": round(raw_rate, 1),
        "raw_p50_ms": round(pct(raw_lat, 50), 3), "raw_p99_ms": round(pct(raw_lat, 99), 3),
        "ratio": round(ratio, 4),
        "api_serial_jobs_per_s": round(serial_api.rate, 1), "api_serial_p50_ms": round(serial_api.p50, 3),
        "api_serial_p99_ms": round(serial_api.p99, 3),
        "raw_serial_msgs_per_s": round(serial_raw.rate, 1), "raw_serial_p50_ms": round(serial_raw.p50, 3),
        "raw_serial_p99_ms": round(serial_raw.p99, 3),
        "cpu_ms_per_api_job": cpu_api, "cpu_ms_per_raw_send": cpu_raw,
        "api_rounds_jobs_per_s": [round(r.rate, 1) for r in api_runs],
        "raw_rounds_msgs_per_s": [round(r.rate, 1) for r in raw_runs],
        "queued_seen": queued, "queued_expected": expected_queued,
        "stream_events": stream["events"], "stream_interval_ms": args.interval_ms,
        "stream_p50_ms": round(stream["p50"], 3), "stream_p99_ms": round(stream["p99"], 3),
        "stream_max_ms": round(stream["max"], 3),
        "targets": {"ratio_min": TARGET_RATIO, "ratio_pass": ratio_ok,
                    "stream_p99_ms_max": TARGET_STREAM_P99_MS, "stream_pass": stream_ok},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
