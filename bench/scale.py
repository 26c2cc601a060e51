"""What one job costs Postgres and Redis, and what one Postgres primary and one Redis take here.

    python bench/scale.py [--jobs 200] [--max-tokens 16,128] [--batch-max-tokens 128] [--max-num-seqs 32]
                          [--concurrency 16] [--idle-seconds 20] [--pgbench-seconds 15] [--postgres-url URL]
                          [--fleet 1,2,4 [--fleet-jobs 1600] [--fleet-max-tokens 128]]
                          [--affinity [--documents 40] [--questions 8] [--document-tokens 1000]
                                      [--affinity-max-tokens 8] [--line-order grouped|shuffled]]
                          [--costs]

Three parts: the per-job costs and capacities (parts 1-3 and Capacity below; what runs with
no part named), `--fleet` (Fleet below) and `--affinity` (Affinity below). Naming `--fleet`
or `--affinity` runs only those; add `--costs` for the first part too.

The figures behind docs/deployment.md's "How a deployment grows": every worker added to a
deployment adds its jobs' load to the one Postgres and the one Redis they share, so these
per-job costs and the servers' own rates say where adding workers stops helping.

The stack is the deployed one on loopback: a `redis-server` of its own on a free port (so
that INFO commandstats counts rein's commands alone: other programs use the shared Redis),
a throwaway database `rein_bench_<random>` on the given Postgres (bench/intake.py's Sandbox,
dropped at the end; pg_stat_database counts per database, so neighbours do not count), a key,
then `rein api` and one `rein worker` on the tiny random-weight llama as subprocesses
(bench/batch.py's Service: cpu, fp32, one torch thread). After a warm-up:

1. idle: nothing submitted for `--idle-seconds`: the background rate of transactions, row
   writes and Redis commands (the worker's heartbeat, lease renewals, the reaper, the batch
   manager's poll, Celery's blocking pops), per second;
2. for each `--max-tokens` value: `--jobs` async jobs (POST /v1/jobs, /v1/completions bodies,
   greedy, ignore_eos so each produces exactly max_tokens) sent over `--concurrency`
   connections, then waited for;
3. a batch of `--jobs` such lines of `--batch-max-tokens` (Files + Batches API: batch
   priority, whose token events the worker coalesces), waited for until `completed`.

Each load's deltas, less the background rate over its length (and less this script's own
queries of the jobs and batches tables, one transaction each), are divided by the jobs and
by the tokens generated. A second after the first job runs, one reading of the keys the KEDA
ScaledObject watches (deploy/k8s: the model's two lists and kombu's `unacked` hash, the
messages workers have taken), of the jobs running, and of the connections the API's and the
worker's pools hold.

Postgres: transactions committed (`xact_commit`: reads count too: each auth lookup, claim,
lease renewal, record), rows written (`tup_inserted + tup_updated + tup_deleted`) and per
table (pg_stat_user_tables). Redis: calls in INFO commandstats (commands run inside a Lua
script are counted under their own names too, besides the EVALSHA). Postgres statistics reach
the views up to 10 s after a transaction (Postgres 15 flushes an idle backend's pending
statistics on a timer), so every reading waits `STATS_SETTLE_SECONDS` first.

Capacity: `pgbench` (TPC-B-like, `--pgbench-clients` clients, `--pgbench-seconds`) on a
throwaway database on the same Postgres, and `redis-benchmark` (SET, LPUSH, EVALSHA-free
plain commands, pipelining 1) against the private redis-server: what this machine's
single Postgres and single Redis commit and answer. Both run on the same 2 cores as
everything else, so they are a floor for a dedicated server, not a ceiling.

Fleet (`--fleet 1,2,4`): output tokens/s of each count of workers on one Redis (the private
redis-server) and one Postgres database (a Sandbox of its own), behind one `rein api`. Workers
are added between loads, each with a `--hostname` of its own; each count is warmed up
(`WARMUP_JOBS` short jobs per worker), then gets the same load: `--fleet-jobs` async jobs of
`--fleet-max-tokens` (greedy, ignore_eos), timed from the first POST until the last job ends.
Printed: tokens/s per count, its ratio to the first count's (measured in the same run), and the
jobs each worker ran. Workers are pinned, worker i to core i and the API to core 0 (all their
threads, right after each starts: the engine process a worker starts inherits the mask), only
where the machine has a core for each of the largest count's workers and one for the API;
otherwise (as on a 2-core machine) nothing is pinned, and the output says so with the core
count. Postgres, Redis and this script are never pinned.

Affinity (`--affinity`): a batch (Files + Batches API, OpenAI batch JSONL) of `--documents` x
`--questions` /v1/completions lines, each prompt a document of about `--document-tokens` tokens
(words of bench/batch.py's vocabulary from a seeded RNG, so every document differs from its
first block) followed by a short question, `--affinity-max-tokens` tokens each (greedy,
ignore_eos), the lines grouped by document in the file or shuffled (`--line-order`; the batch
manager's default REIN_BATCH_ORDER=prefix sends them in prefix order either way). The tiny
model's context is `AFFINITY_MAX_MODEL_LEN` (2048, its max_position_embeddings) here; the KV
cache (`--kv-cache-memory`, 256 MiB: 512 bytes a token of the tiny llama, some 500k tokens)
holds every document (40k tokens at the defaults), and the prefix cache is on (the engine's
default, REIN_ENABLE_PREFIX_CACHING). Three runs, each on a fresh database and fresh workers
(cold prefix caches), warmed up with short jobs first: one worker (the baseline), then two
workers with REIN_BATCH_AFFINITY=1 and with =0 (the API's and the workers' environment). Per run: wall
seconds from the upload until the batch is `completed`; prompt tokens computed = the sum over
the batch's usage rows of prompt_tokens - cached_tokens (the prefix cache's hits are not
computed again), and its ratio to the one-worker run's; the share of the lines each worker ran
(jobs.worker, its hostname). Pinning as for the fleet, decided for two workers for all three
runs (so the one-worker run's wall time compares).

The last line of stdout is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batch import WORDS, Service  # noqa: E402  (bench helpers)
from intake import Sandbox, check_loopback, ensure_model, free_port  # noqa: E402

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 512
PROMPT = "Write one short sentence about queues and workers."
# Postgres 15 flushes a backend's pending statistics at most once a second, and an idle
# backend's within PGSTAT_IDLE_INTERVAL (10 s): a reading waits that long so it has every one.
STATS_SETTLE_SECONDS = 11.0
POLL_SECONDS = 0.5
WARMUP_JOBS = 8
# The affinity part's prompts (a ~1000-token document and a question) need a longer context: the
# tiny llama's max_position_embeddings.
AFFINITY_MAX_MODEL_LEN = 2048
SEED = 0


# -- readings ---------------------------------------------------------------------------------


class Counters:
    """Postgres statistics of the sandbox database (read over a connection to another database,
    so reading them adds no transaction to it) and the private Redis' command calls."""

    def __init__(self, sandbox: Sandbox, redis_url: str) -> None:
        import psycopg
        import redis

        from rein.store.db import psycopg_conninfo

        self.db_name = sandbox.db_name
        self.stats = psycopg.connect(autocommit=True,
                                     **psycopg_conninfo(sandbox.server_url.set(database="postgres")))
        self.redis = redis.Redis.from_url(redis_url)

    def read(self) -> dict:
        time.sleep(STATS_SETTLE_SECONDS)
        row = self.stats.execute(
            "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted "
            "FROM pg_stat_database WHERE datname = %s", (self.db_name,)).fetchone()
        commands = {name.removeprefix("cmdstat_"): stats["calls"]
                    for name, stats in self.redis.info("commandstats").items()}
        cpu = self.redis.info("cpu")
        return {"t": time.monotonic(), "xact_commit": row[0], "xact_rollback": row[1],
                "rows_written": row[2] + row[3] + row[4], "commands": commands,
                "redis_cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"]}

    def queue_snapshot(self, settings) -> dict[str, int]:
        """What the ScaledObject's triggers would read now (deploy/k8s/base/worker-scaledobject.yaml):
        the model's interactive and batch lists and kombu's hash of taken messages. Three
        commands, which the caller subtracts."""
        from kombu.transport.redis import Channel

        from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
        from rein.jobs.queues import queue_keys

        lists = queue_keys(settings, MODEL_NAME)
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(lists[PRIORITY_INTERACTIVE])
        pipe.llen(lists[PRIORITY_BATCH])
        pipe.hlen(settings.redis_key_prefix + Channel.unacked_key)
        interactive, batch, in_flight = pipe.execute()
        return {"interactive": interactive, "batch": batch, "in_flight": in_flight}

    def connections(self) -> int:
        """Connections open to the sandbox database now (the API's and the worker's pools, and
        this script's one)."""
        return self.stats.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                                  (self.db_name,)).fetchone()[0]

    def close(self) -> None:
        self.stats.close()
        self.redis.close()


class JobsTable:
    """This script's one connection to the sandbox database (the jobs table, and the per-table
    statistics, which only a connection to that database sees); every query is one
    transaction there, counted so it can be subtracted."""

    def __init__(self, database_url: str) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        from rein.store.db import psycopg_conninfo

        self.conn = psycopg.connect(autocommit=True, **psycopg_conninfo(make_url(database_url)))
        self.queries = 0

    def one(self, sql: str, params: tuple = ()) -> tuple:
        self.queries += 1
        return self.conn.execute(sql, params).fetchone()

    def table_writes(self) -> dict[str, int]:
        self.queries += 1
        rows = self.conn.execute("SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables").fetchall()
        return {name: int(count) for name, count in rows}

    def close(self) -> None:
        self.conn.close()


def delta(after: dict, before: dict) -> dict:
    commands = {name: calls - before["commands"].get(name, 0) for name, calls in after["commands"].items()}
    return {"seconds": after["t"] - before["t"], "xact_commit": after["xact_commit"] - before["xact_commit"],
            "xact_rollback": after["xact_rollback"] - before["xact_rollback"],
            "rows_written": after["rows_written"] - before["rows_written"],
            "redis_cpu_s": after["redis_cpu_s"] - before["redis_cpu_s"],
            "commands": {name: calls for name, calls in commands.items() if calls}}


# -- the load ---------------------------------------------------------------------------------


async def submit(base_url: str, key: str, jobs: int, max_tokens: int, concurrency: int) -> None:
    import httpx

    body = {"endpoint": "/v1/completions",
            "body": {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True}}
    todo = iter(range(jobs))

    async def sender(client: httpx.AsyncClient) -> None:
        for _ in todo:
            response = await client.post("/v1/jobs", json=body)
            if response.status_code != 202:
                raise RuntimeError(f"POST /v1/jobs answered {response.status_code}: {response.text[:300]}")

    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {key}"},
                                 timeout=60) as client:
        await asyncio.gather(*(sender(client) for _ in range(concurrency)))


def wait_done(table: JobsTable, total: int, timeout: float) -> tuple[int, int]:
    """Poll until `total` jobs have ended; (succeeded, completion tokens) over all jobs so far."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ended, = table.one("SELECT count(*) FROM jobs WHERE status IN ('succeeded', 'failed', 'cancelled')")
        if ended >= total:
            succeeded, = table.one("SELECT count(*) FROM jobs WHERE status = 'succeeded'")
            tokens, = table.one("SELECT coalesce(sum(completion_tokens), 0) FROM usage")
            return int(succeeded), int(tokens)
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"jobs not done after {timeout:.0f} s")


# -- capacity ---------------------------------------------------------------------------------


def pgbench(server_url, clients: int, seconds: int) -> dict | None:
    """TPC-B-like transactions per second on a throwaway database (scale 10), or None without pgbench."""
    import psycopg
    from psycopg import sql

    from rein.store.db import psycopg_conninfo

    if shutil.which("pgbench") is None:
        return None
    name = f"rein_pgbench_{os.getpid()}"
    conninfo = psycopg_conninfo(server_url.set(database="postgres"))
    with psycopg.connect(autocommit=True, **conninfo) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    env = {**os.environ, "PGHOST": server_url.host or "127.0.0.1", "PGPORT": str(server_url.port or 5432),
           "PGUSER": server_url.username or "postgres"}
    if server_url.password:
        env["PGPASSWORD"] = server_url.password
    try:
        subprocess.run(["pgbench", "-i", "-q", "-s", "10", name], env=env, check=True, capture_output=True)
        out = subprocess.run(["pgbench", "-c", str(clients), "-j", "2", "-T", str(seconds), name],
                             env=env, check=True, capture_output=True, text=True).stdout
    finally:
        with psycopg.connect(autocommit=True, **conninfo) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    tps = next(float(line.split("=")[1].split()[0]) for line in out.splitlines() if line.startswith("tps ="))
    return {"tps": round(tps), "clients": clients, "seconds": seconds, "script": "tpcb-like, scale 10"}


def redis_benchmark(port: int) -> dict | None:
    """Requests/s of plain SET and LPUSH (50 clients, no pipelining), or None without redis-benchmark."""
    if shutil.which("redis-benchmark") is None:
        return None
    out = subprocess.run(["redis-benchmark", "-p", str(port), "-n", "100000", "-c", "50", "-t", "set,lpush",
                          "--csv"], check=True, capture_output=True, text=True).stdout
    rates = {}
    for line in out.splitlines():
        fields = [field.strip('"') for field in line.split(",")]
        if fields[0] in ("SET", "LPUSH"):
            rates[fields[0]] = round(float(fields[1]))
    return {"requests_per_s": rates, "clients": 50, "pipeline": 1}


# -- the run ----------------------------------------------------------------------------------


def start_redis(work_dir: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(work_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.1)
    client.close()
    return proc, port


def per_unit(net: dict, jobs: int, tokens: int) -> dict:
    top = sorted(net["commands"].items(), key=lambda item: -item[1])[:8]
    return {
        "jobs": jobs, "completion_tokens": tokens, "seconds": round(net["seconds"], 1),
        "pg_transactions_per_job": round(net["xact_commit"] / jobs, 2),
        "pg_rows_written_per_job": round(net["rows_written"] / jobs, 2),
        "redis_commands_per_job": round(net["redis_total"] / jobs, 1),
        "redis_commands_per_token": round(net["redis_total"] / tokens, 3),
        # Redis' own CPU (INFO cpu): one core at 100% takes 1e6 / this tokens per second.
        "redis_cpu_us_per_token": round(net["redis_cpu_s"] * 1e6 / tokens, 2),
        "redis_top_commands_per_job": {name: round(calls / jobs, 2) for name, calls in top},
        "pg_rows_written_per_job_by_table": net["tables"],
    }


def measure_run(label: str, load, jobs: int, table: JobsTable, counters: Counters, settings,
                idle: dict, phase) -> dict:
    """One load (`load()` submits `jobs` jobs and returns) and its costs, net of the background."""
    tables_before = table.table_writes()
    (submitted,) = table.one("SELECT count(*) FROM jobs")
    _, tokens_before = wait_done(table, submitted, 60)
    before = counters.read()
    queries_before = table.queries
    started = time.monotonic()
    load()
    # What the ScaledObject's triggers read once jobs run, and the connections the pools hold.
    wait_for_running(table)
    time.sleep(1.0)   # the worker's first claims done: how many messages it took beyond them
    snapshot = counters.queue_snapshot(settings)
    connections = counters.connections()
    (running,) = table.one("SELECT count(*) FROM jobs WHERE status = 'running'")
    succeeded, tokens_after = wait_done(table, submitted + jobs, 1800)
    wait_batches_finished(table, 300)
    wall = time.monotonic() - started
    polls = table.queries - queries_before
    after = counters.read()
    tables_after = table.table_writes()
    raw = delta(after, before)
    seconds = raw["seconds"]

    def background(name: str) -> float:
        return idle[name] / idle["seconds"] * seconds

    net = {"seconds": wall,
           "xact_commit": raw["xact_commit"] - polls - background("xact_commit"),
           "rows_written": raw["rows_written"] - background("rows_written"),
           "redis_total": sum(raw["commands"].values()) - len(snapshot)
                          - sum(idle["commands"].values()) / idle["seconds"] * seconds,
           "redis_cpu_s": raw["redis_cpu_s"] - background("redis_cpu_s"),
           "commands": {name: calls - idle["commands"].get(name, 0) / idle["seconds"] * seconds
                        for name, calls in raw["commands"].items()},
           "tables": {name: round((tables_after.get(name, 0) - count) / jobs, 2)
                      for name, count in tables_before.items() if tables_after.get(name, 0) > count}}
    net["commands"]["llen"] -= 2     # the snapshot's own reads
    net["commands"]["hlen"] -= 1
    result = per_unit(net, jobs, tokens_after - tokens_before) | {
        "failed": submitted + jobs - succeeded, "queues_while_running": snapshot, "jobs_running": running,
        "pg_connections_while_running": connections, "this_script_queries_subtracted": polls}
    phase(f"{label}: {wall:.1f} s, {result['pg_transactions_per_job']} transactions and "
          f"{result['pg_rows_written_per_job']} rows written per job; {result['redis_commands_per_job']} Redis "
          f"commands per job, {result['redis_commands_per_token']} per token, {result['redis_cpu_us_per_token']} "
          f"µs of Redis CPU per token; while running: {snapshot} with {running} jobs running, "
          f"{connections} Postgres connections")
    return result


def wait_batches_finished(table: JobsTable, timeout: float) -> None:
    """A batch's jobs end before the batch does: its output file is written then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (open_batches,) = table.one("SELECT count(*) FROM batches WHERE status NOT IN "
                                    "('completed', 'failed', 'expired', 'cancelled')")
        if not open_batches:
            return
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"a batch did not finish within {timeout:.0f} s")


def wait_for_running(table: JobsTable, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (running,) = table.one("SELECT count(*) FROM jobs WHERE status = 'running'")
        if running:
            return
        time.sleep(0.1)


def submit_batch(base_url: str, key: str, lines: int, max_tokens: int, work_dir: Path) -> None:
    """Upload a batch file of `lines` completions and create its batch (Files + Batches API)."""
    from rein.cli.batch import BatchClient

    path = work_dir / f"batch-{max_tokens}.jsonl"
    with path.open("w") as out:
        for i in range(lines):
            body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            out.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n")
    with BatchClient(base_url, key) as client:
        client.create_batch(client.upload(path)["id"], "/v1/completions", "24h", None)


def measure_costs(args: argparse.Namespace, redis_port: int, work_dir: Path, model_dir: Path, phase) -> dict:
    """Parts 1-3 (the idle rate, the async loads, the batch) and redis-benchmark."""
    from rein.core.settings import Settings
    from rein.store.redis_keys import RedisKeys

    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    sandbox = Sandbox(args.postgres_url, redis_url)
    service = counters = table = None
    try:
        sandbox.migrate()
        key = new_key(sandbox)
        service = Service(sandbox, model_dir, work_dir, args, name="scale", max_model_len=MAX_MODEL_LEN)
        service.wait_ready(RedisKeys(sandbox.prefix.rstrip(":")).worker_heartbeat(service.hostname))
        phase(f"rein api ({service.base_url}) and rein worker ready; redis-server on port {redis_port}")
        settings = Settings(redis_url=redis_url, redis_key_prefix=sandbox.prefix)
        table = JobsTable(sandbox.database_url)
        counters = Counters(sandbox, redis_url)
        asyncio.run(submit(service.base_url, key, WARMUP_JOBS, 8, 4))
        wait_done(table, WARMUP_JOBS, 120)

        before = counters.read()
        time.sleep(args.idle_seconds)
        idle = delta(counters.read(), before)
        rate = {"xact_commit": idle["xact_commit"] / idle["seconds"],
                "rows_written": idle["rows_written"] / idle["seconds"],
                "redis": sum(idle["commands"].values()) / idle["seconds"],
                "redis_cpu_s": idle["redis_cpu_s"] / idle["seconds"]}
        phase(f"idle: {rate['xact_commit']:.2f} transactions/s, {rate['redis']:.1f} Redis commands/s "
              f"(background, whatever the load)")

        runs = []
        for max_tokens in args.max_tokens:
            def jobs_load(max_tokens: int = max_tokens) -> None:
                asyncio.run(submit(service.base_url, key, args.jobs, max_tokens, args.concurrency))
            runs.append(measure_run(f"{args.jobs} jobs, max_tokens {max_tokens}", jobs_load, args.jobs,
                                    table, counters, settings, idle, phase) | {"max_tokens": max_tokens})
        if args.batch_max_tokens:
            def batch_load() -> None:
                submit_batch(service.base_url, key, args.jobs, args.batch_max_tokens, work_dir)
            runs.append(measure_run(f"a batch of {args.jobs} lines, max_tokens {args.batch_max_tokens}",
                                    batch_load, args.jobs, table, counters, settings, idle, phase)
                        | {"max_tokens": args.batch_max_tokens, "batch": True})
        return {"background_per_s": {name: round(value, 2) for name, value in rate.items()}, "runs": runs,
                "redis_benchmark": redis_benchmark(redis_port)}
    finally:
        for closable in (counters, table):
            if closable is not None:
                closable.close()
        if service is not None:
            service.stop()
        sandbox.drop_database()


def measure(args: argparse.Namespace, work_dir: Path, phase) -> dict:
    """The parts asked for, each on a throwaway database of its own, all on one private redis-server."""
    model_dir = ensure_model("tiny")
    redis_proc, redis_port = start_redis(work_dir)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    figures: dict = {}
    try:
        if args.costs:
            figures.update(measure_costs(args, redis_port, work_dir, model_dir, phase))
        if args.fleet:
            figures["fleet"] = measure_fleet(args, redis_url, work_dir, model_dir, phase)
        if args.affinity:
            figures["affinity"] = measure_affinity(args, redis_url, work_dir, model_dir, phase)
        return figures
    finally:
        redis_proc.send_signal(signal.SIGTERM)
        redis_proc.wait(timeout=10)


# -- fleets: several workers on one sandbox ----------------------------------------------------


def cores() -> int:
    """The cores this process may run on (its affinity mask; os.cpu_count() elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def pin(pid: int, core: int) -> None:
    """Every thread of `pid` on `core` (Linux: one thread per call; threads and processes it
    starts later take their creator's mask, so the worker's engine process follows it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), {core})
        except (ProcessLookupError, PermissionError):
            continue


class Fleet:
    """`rein api` and `workers` `rein worker`s on one sandbox: bench/batch.py's Service (the API
    and the first worker) and more workers started alike, each with a --hostname of its own. With
    `pinned`, the API on core 0 and worker i on core i (right after each starts, so its threads
    and its engine process inherit the mask)."""

    def __init__(self, sandbox: Sandbox, model_dir: Path, log_dir: Path, args: argparse.Namespace, *,
                 name: str, workers: int, pinned: bool, max_model_len: int = MAX_MODEL_LEN,
                 env: dict[str, str] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.sandbox = sandbox
        self.name = name
        self.pinned = pinned
        self.service = Service(sandbox, model_dir, log_dir, args, name=name, max_model_len=max_model_len, env=env)
        self.workers = [(self.service.hostname, self.service.worker)]
        if pinned:
            pin(self.service.api.pid, 0)
            pin(self.service.worker.pid, 1)
        self.add_workers(workers - 1)

    def add_workers(self, count: int) -> None:
        for _ in range(count):
            number = len(self.workers) + 1
            hostname = f"bench-{self.name}-{self.sandbox.tag}-w{number}@localhost"
            proc = self.service._spawn(f"worker{number}", "worker", "--model", MODEL_NAME, "--hostname", hostname,
                                       "--loglevel", "warning")
            if self.pinned:
                pin(proc.pid, number)
            self.workers.append((hostname, proc))

    def wait_ready(self) -> None:
        """The API ready and every worker's heartbeat in Redis (its engine loaded)."""
        import redis

        from rein.store.redis_keys import RedisKeys

        keys = RedisKeys(self.sandbox.prefix.rstrip(":"))
        self.service.wait_ready(keys.worker_heartbeat(self.service.hostname))
        client = redis.Redis.from_url(self.sandbox.redis_url)
        deadline = time.monotonic() + 180
        try:
            for number, (hostname, proc) in enumerate(self.workers, 1):
                while not client.exists(keys.worker_heartbeat(hostname)):
                    if proc.poll() is not None:
                        raise RuntimeError(f"worker {hostname} exited with {proc.returncode}:\n"
                                           f"{self.service.tail(f'worker{number}')}")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"worker {hostname} not ready after 180 s")
                    time.sleep(0.25)
        finally:
            client.close()
        if len(self.workers) > 1:
            # Each worker reads who else beats at its own next beat, and splits the batch queue's
            # shards with them then (rein.jobs.affinity): a beat more, and every worker has.
            from rein.worker.heartbeat import HEARTBEAT_SECONDS

            time.sleep(HEARTBEAT_SECONDS + 1)

    def stop(self) -> None:
        self.service.stop()


def new_key(sandbox: Sandbox) -> str:
    from sqlalchemy.orm import sessionmaker
    from sqlalchemy.pool import NullPool

    from rein.store.db import make_engine
    from rein.store.keys import create_key

    engine = make_engine(sandbox.database_url, poolclass=NullPool)
    try:
        with sessionmaker(engine).begin() as session:
            return create_key(session, name="bench-scale", tenant="bench", scopes=["inference", "batch"]).key
    finally:
        engine.dispose()


def jobs_by_worker(table: JobsTable, where: str = "TRUE", params: tuple = ()) -> dict[str, int]:
    table.queries += 1
    rows = table.conn.execute(f"SELECT coalesce(worker, '?'), count(*) FROM jobs WHERE {where} GROUP BY 1 "
                              "ORDER BY 1", params).fetchall()
    return {worker: int(count) for worker, count in rows}


def measure_fleet(args: argparse.Namespace, redis_url: str, work_dir: Path, model_dir: Path, phase) -> dict:
    """Output tokens/s of 1, 2, 4 ... workers (`--fleet`) on one API, one Redis and one Postgres
    database: workers are added between loads (each count's new workers warmed up first), and
    each count gets the same load, `--fleet-jobs` async jobs of `--fleet-max-tokens`."""
    counts = sorted(set(args.fleet))
    have = cores()
    pinned = have >= counts[-1] + 1
    phase(f"fleet: {have} cores; workers {'pinned, one core each (the API on core 0)' if pinned else 'NOT pinned'}"
          + ("" if pinned else f" ({counts[-1]} workers + the API need {counts[-1] + 1} cores)"))
    sandbox = Sandbox(args.postgres_url, redis_url)
    fleet = table = None
    runs = []
    try:
        sandbox.migrate()
        key = new_key(sandbox)
        fleet = Fleet(sandbox, model_dir, work_dir / "fleet", args, name="fleet", workers=counts[0], pinned=pinned)
        table = JobsTable(sandbox.database_url)
        submitted = 0
        for count in counts:
            fleet.add_workers(count - len(fleet.workers))
            fleet.wait_ready()
            warmup = WARMUP_JOBS * count
            asyncio.run(submit(fleet.service.base_url, key, warmup, 8, 4))
            submitted += warmup
            _, tokens_before = wait_done(table, submitted, 300)
            before = jobs_by_worker(table)
            started = time.monotonic()
            asyncio.run(submit(fleet.service.base_url, key, args.fleet_jobs, args.fleet_max_tokens, args.concurrency))
            submitted += args.fleet_jobs
            succeeded, tokens_after = wait_done(table, submitted, 1800)
            wall = time.monotonic() - started
            after = jobs_by_worker(table)
            tokens = tokens_after - tokens_before
            share = {worker: jobs - before.get(worker, 0) for worker, jobs in after.items()
                     if jobs - before.get(worker, 0)}
            runs.append({"workers": count, "seconds": round(wall, 2), "completion_tokens": tokens,
                         "tokens_per_s": round(tokens / wall, 1), "failed": submitted - succeeded,
                         "jobs_by_worker": share, "load_average_1m": round(os.getloadavg()[0], 2)})
            phase(f"fleet, {count} worker(s): {args.fleet_jobs} jobs x {args.fleet_max_tokens} tokens in {wall:.1f} s: "
                  f"{tokens / wall:.1f} tok/s; jobs by worker {sorted(share.values(), reverse=True)}")
    finally:
        if table is not None:
            table.close()
        if fleet is not None:
            fleet.stop()
        sandbox.delete_keys()
        sandbox.drop_database()
    base = runs[0]["tokens_per_s"]
    for run in runs:
        run["ratio_vs_first"] = round(run["tokens_per_s"] / base, 3)
    print(f"fleet: {args.fleet_jobs} async jobs x {args.fleet_max_tokens} tokens (greedy, ignore_eos) per count; "
          f"{have} cores, workers {'pinned one core each' if pinned else 'unpinned'}")
    print(f"  {'workers':>7} {'seconds':>8} {'tok/s':>8} {f'vs {counts[0]}':>6}  jobs by worker")
    for run in runs:
        print(f"  {run['workers']:>7} {run['seconds']:>8.1f} {run['tokens_per_s']:>8.1f} {run['ratio_vs_first']:>5.2f}x  "
              f"{sorted(run['jobs_by_worker'].values(), reverse=True)}")
    return {"cores": have, "pinned": pinned, "jobs": args.fleet_jobs, "max_tokens": args.fleet_max_tokens, "runs": runs}


# -- batch affinity: documents x questions on two workers ---------------------------------------


QUESTIONS = ("Which word comes up most often in the text above?", "Summarise the text above in one line.",
             "What is the third word of the text above?", "Name a word the text above never uses.",
             "How many sentences does the text above have?", "Which word comes last in the text above?",
             "Is the word river in the text above?", "Give the text above a title.")


def write_documents(path: Path, model_dir: Path, args: argparse.Namespace) -> int:
    """The affinity batch file: `--documents` texts of about `--document-tokens` tokens each (words of
    bench/batch.py's vocabulary, seeded), each followed by `--questions` short questions, one
    /v1/completions line each; grouped by document or shuffled (`--line-order`). Returns the lines."""
    import random

    from transformers import AutoTokenizer

    rng = random.Random(SEED)
    sample = " ".join(rng.choice(WORDS) for _ in range(500))
    tokens_per_word = len(AutoTokenizer.from_pretrained(str(model_dir))(sample).input_ids) / 500
    words = max(1, round(args.document_tokens / tokens_per_word))
    lines = []
    for doc in range(args.documents):
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        for q in range(args.questions):
            question = QUESTIONS[q % len(QUESTIONS)] + (f" ({q // len(QUESTIONS) + 1})" if q >= len(QUESTIONS) else "")
            body = {"model": MODEL_NAME, "prompt": f"{text}\n\nQuestion: {question}\nAnswer:",
                    "max_tokens": args.affinity_max_tokens, "temperature": 0, "ignore_eos": True}
            lines.append({"custom_id": f"doc-{doc}-q-{q}", "method": "POST", "url": "/v1/completions", "body": body})
    if args.line_order == "shuffled":
        rng.shuffle(lines)
    with path.open("w") as out:
        for line in lines:
            out.write(json.dumps(line) + "\n")
    return len(lines)


def affinity_run(args: argparse.Namespace, redis_url: str, work_dir: Path, model_dir: Path, input_path: Path,
                 label: str, workers: int, env: dict[str, str], pinned: bool, phase) -> dict:
    """One run of the affinity batch on a fresh sandbox and fresh workers (empty prefix caches)."""
    from rein.cli.batch import BatchClient

    sandbox = Sandbox(args.postgres_url, redis_url)
    fleet = table = None
    try:
        sandbox.migrate()
        key = new_key(sandbox)
        fleet = Fleet(sandbox, model_dir, work_dir / f"affinity-{label.replace(' ', '-')}", args, name="affinity",
                      workers=workers, pinned=pinned, max_model_len=AFFINITY_MAX_MODEL_LEN, env=env)
        fleet.wait_ready()
        table = JobsTable(sandbox.database_url)
        asyncio.run(submit(fleet.service.base_url, key, WARMUP_JOBS * workers, 8, 4))   # short prompts
        wait_done(table, WARMUP_JOBS * workers, 300)
        with BatchClient(fleet.service.base_url, key) as client:
            started = time.monotonic()
            batch = client.create_batch(client.upload(input_path)["id"], "/v1/completions", "24h", None)
            while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(POLL_SECONDS)
                batch = client.batch(batch["id"])
            wall = time.monotonic() - started
        if batch["status"] != "completed":
            raise RuntimeError(f"the affinity batch ended {batch['status']}: {json.dumps(batch)[:1000]}")
        table.queries += 1
        rows = table.conn.execute(
            "SELECT coalesce(j.worker, '?'), count(*), coalesce(sum(u.prompt_tokens), 0), "
            "coalesce(sum(u.prompt_tokens - u.cached_tokens), 0), count(*) FILTER (WHERE j.status <> 'succeeded') "
            "FROM jobs j LEFT JOIN usage u ON u.job_id = j.id WHERE j.batch_id = %s GROUP BY 1 ORDER BY 1",
            (batch["id"],)).fetchall()
    finally:
        if table is not None:
            table.close()
        if fleet is not None:
            fleet.stop()
        sandbox.delete_keys()
        sandbox.drop_database()
    lines = sum(row[1] for row in rows)
    prompt = sum(int(row[2]) for row in rows)
    computed = sum(int(row[3]) for row in rows)
    result = {"label": label, "workers": workers, "env": env, "pinned": pinned, "seconds": round(wall, 2),
              "lines": lines, "failed": sum(row[4] for row in rows), "prompt_tokens": prompt,
              "prompt_tokens_computed": computed,
              "lines_by_worker": {row[0]: row[1] for row in rows},
              "line_share_by_worker": {row[0]: round(row[1] / lines, 3) for row in rows},
              "prompt_tokens_computed_by_worker": {row[0]: int(row[3]) for row in rows},
              "load_average_1m": round(os.getloadavg()[0], 2)}
    phase(f"affinity, {label}: {wall:.1f} s, {computed} of {prompt} prompt tokens computed; line shares "
          f"{sorted(result['line_share_by_worker'].values(), reverse=True)}")
    return result


def measure_affinity(args: argparse.Namespace, redis_url: str, work_dir: Path, model_dir: Path, phase) -> dict:
    """The documents x questions batch with one worker (the baseline), then two workers with
    REIN_BATCH_AFFINITY=1 and =0; the prompt tokens each computed, against the baseline's."""
    input_path = work_dir / "affinity.jsonl"
    lines = write_documents(input_path, model_dir, args)
    have = cores()
    pinned = have >= 3   # the one-worker run too, so that its wall time compares
    phase(f"affinity: {args.documents} documents x {args.questions} questions = {lines} lines ({args.line_order}), "
          f"~{args.document_tokens} tokens a document, max_tokens {args.affinity_max_tokens}; {have} cores, "
          f"workers {'pinned, one core each (the API on core 0)' if pinned else 'NOT pinned (2 workers + the API need 3 cores)'}")
    runs = [affinity_run(args, redis_url, work_dir, model_dir, input_path, label, workers, env, pinned, phase)
            for label, workers, env in (("one worker", 1, {}),
                                        ("affinity on", 2, {"REIN_BATCH_AFFINITY": "1"}),
                                        ("affinity off", 2, {"REIN_BATCH_AFFINITY": "0"}))]
    base = runs[0]["prompt_tokens_computed"] or 1
    for run in runs:
        run["computed_vs_one_worker"] = round(run["prompt_tokens_computed"] / base, 3)
    print(f"affinity: a batch of {args.documents} documents x {args.questions} questions ({lines} lines, "
          f"{args.line_order}), prompts ~{runs[0]['prompt_tokens'] // max(lines, 1)} tokens, max_tokens "
          f"{args.affinity_max_tokens}; {have} cores, workers {'pinned' if pinned else 'unpinned'}")
    print(f"  {'run':<13} {'workers':>7} {'seconds':>8} {'computed':>9} {'vs 1':>6}  share of lines by worker")
    for run in runs:
        print(f"  {run['label']:<13} {run['workers']:>7} {run['seconds']:>8.1f} {run['prompt_tokens_computed']:>9} "
              f"{run['computed_vs_one_worker']:>5.2f}x  {sorted(run['line_share_by_worker'].values(), reverse=True)}")
    print("  computed: sum over the batch's usage rows of prompt_tokens - cached_tokens (the prefix cache's hits "
          "are not computed)")
    return {"documents": args.documents, "questions": args.questions, "lines": lines, "line_order": args.line_order,
            "document_tokens": args.document_tokens, "max_tokens": args.affinity_max_tokens, "cores": have,
            "pinned": pinned, "runs": runs}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--max-tokens", default="16,128",
                        type=lambda text: [int(part) for part in text.split(",")])
    parser.add_argument("--batch-max-tokens", type=int, default=128,
                        help="then a batch (Files + Batches API) of --jobs lines of this many tokens; 0: none")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--pgbench-seconds", type=int, default=15)
    parser.add_argument("--pgbench-clients", type=int, default=8)
    parser.add_argument("--postgres-url", default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--fleet", default=None, type=lambda text: [int(part) for part in text.split(",")],
                        help="worker counts, e.g. 1,2,4: output tokens/s of each on one Redis and one Postgres")
    parser.add_argument("--fleet-jobs", type=int, default=1600,
                        help="async jobs per worker count (1600: some 25 s with one worker on 2 cores)")
    parser.add_argument("--fleet-max-tokens", type=int, default=128)
    parser.add_argument("--affinity", action="store_true",
                        help="the documents x questions batch: one worker, then two with REIN_BATCH_AFFINITY=1 and 0")
    parser.add_argument("--documents", type=int, default=40)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--affinity-max-tokens", type=int, default=8)
    parser.add_argument("--line-order", choices=("grouped", "shuffled"), default="grouped")
    parser.add_argument("--costs", action="store_true",
                        help="with --fleet or --affinity: the per-job costs and capacity parts too (they run "
                             "alone by default)")
    args = parser.parse_args(argv)
    if args.fleet is not None and (not args.fleet or min(args.fleet) < 1):
        parser.error("--fleet takes worker counts of 1 or more, e.g. 1,2,4")
    if args.document_tokens + 40 + args.affinity_max_tokens > AFFINITY_MAX_MODEL_LEN:
        parser.error(f"--document-tokens: a prompt and its answer must fit in {AFFINITY_MAX_MODEL_LEN} tokens")
    args.costs = args.costs or not (args.fleet or args.affinity)
    return args


def main() -> int:
    args = parse_args()
    check_loopback(args.postgres_url, "postgres")

    def phase(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    from sqlalchemy.engine import make_url

    with tempfile.TemporaryDirectory(prefix="rein-scale-") as tmp:
        figures = measure(args, Path(tmp), phase)
    if args.costs:
        figures["pgbench"] = pgbench(make_url(args.postgres_url), args.pgbench_clients, args.pgbench_seconds)
    figures["load_average_1m"] = round(os.getloadavg()[0], 2)
    figures["cores"] = cores()
    figures["settings"] = {"jobs": args.jobs, "max_num_seqs": args.max_num_seqs, "concurrency": args.concurrency,
                           "model": "tiny llama (cpu, fp32)",
                           "parts": [part for part in ("costs", "fleet", "affinity") if getattr(args, part)]}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
