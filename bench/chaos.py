"""Faults under load: how long rein takes to finish every accepted job after each fault, and
that none is lost or billed twice.

    python bench/chaos.py [--jobs 40] [--max-tokens 192] [--max-num-seqs 16]
                          [--faults worker,redis,postgres,api] [--outage-seconds 20]

A stack of its own: a `redis-server` and a Postgres cluster (initdb) on free loopback ports
in a temp dir (so killing them touches nothing else), `rein api` and two `rein worker`s on
the tiny random-weight llama (.cache/bench-models/llama-tiny), every recovery setting at
its default (REIN_LEASE_SECONDS 30, REIN_LEASE_RENEW_SECONDS 10, REIN_REAPER_INTERVAL_SECONDS
5, REIN_REQUEUE_UNCLAIMED_SECONDS 15). For each fault, `--jobs` greedy completions of
`--max-tokens` tokens are submitted (POST /v1/jobs), the fault is injected once at least
four of them run, and the benchmark waits for every accepted job to end:

* worker: SIGKILL one of the two workers (it runs jobs and holds reserved messages); a
  new worker is started after the measurement, for the next fault;
* redis: SIGKILL redis-server and start it again at once, empty (no AOF, no RDB);
* postgres: `pg_ctl stop -m fast`, wait `--outage-seconds`, start it again;
* api: SIGKILL `rein api` and start it again.

Per fault it prints: jobs accepted, ended, lost (accepted but not succeeded; must be 0),
billed twice (more than one usage row; must be 0), and the seconds from the fault to the last
job's end — for redis and postgres from the moment the server is back. The last line of
stdout is one JSON object with every figure. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e"), str(Path(__file__).resolve().parent)]

from chaos_support import (  # noqa: E402  (the fault tests' helpers)
    Stack,
    hostname_of,
    running,
    running_on,
    submit_all,
    tally,
    wait_all_ended,
    wait_ready,
)
from e2e_support import MODEL, run_service  # noqa: E402
from intake import ensure_model  # noqa: E402  (bench helpers)
from own_servers import PostgresCluster, RedisServer  # noqa: E402

END_TIMEOUT = 600.0
FAULTS = ("worker", "redis", "postgres", "api")


def worker_fault(stack: Stack, ids: list[str], args: argparse.Namespace) -> float:
    service = stack.service
    victim = service.workers[-1]
    name = hostname_of(victim)
    _wait(lambda: running_on(stack, ids, name) >= 4, f"{name} to run jobs")
    victim.send_signal(signal.SIGKILL)
    return time.monotonic()


def redis_fault(stack: Stack, ids: list[str], args: argparse.Namespace) -> float:
    _wait(lambda: running(stack, ids) >= 4, "jobs to run")
    stack.redis.kill()
    stack.redis.start()
    return time.monotonic()


def postgres_fault(stack: Stack, ids: list[str], args: argparse.Namespace) -> float:
    _wait(lambda: running(stack, ids) >= 4, "jobs to run")
    stack.postgres.stop()
    time.sleep(args.outage_seconds)
    stack.postgres.start()
    return time.monotonic()


def api_fault(stack: Stack, ids: list[str], args: argparse.Namespace) -> float:
    service = stack.service
    _wait(lambda: running(stack, ids) >= 4, "jobs to run")
    service.api.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    service.api.wait(10)
    service.api = service.spawn(f"api-{time.monotonic_ns()}", "api")
    return killed


INJECT = {"worker": worker_fault, "redis": redis_fault, "postgres": postgres_fault, "api": api_fault}
WHAT = {"worker": "SIGKILL one of two workers", "redis": "SIGKILL Redis, restart it empty",
        "postgres": "Postgres stopped {s} s", "api": "SIGKILL the API, restart it"}


def _wait(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def _replace_dead_workers(stack: Stack) -> None:
    from rein.store.redis_keys import RedisKeys

    service = stack.service
    for proc in [p for p in service.workers if p.poll() is not None]:
        service.workers.remove(proc)
        name = f"bench-worker-{time.monotonic_ns()}@localhost"
        service.workers.append(service.spawn(name, "worker", "--model", MODEL, "--hostname", name))
        beat = RedisKeys(service.env["REIN_REDIS_KEY_PREFIX"].rstrip(":")).worker_heartbeat(name)
        _wait(lambda b=beat: service.redis.exists(b), f"worker {name} to start", 180)


def run_fault(stack: Stack, fault: str, args: argparse.Namespace) -> dict:
    wait_ready(stack.service)
    with stack.service.client("a", timeout=60) as client:
        ids = submit_all(client, args.jobs, args.max_tokens)
    at = INJECT[fault](stack, ids, args)
    try:
        seconds = wait_all_ended(stack, ids, at, END_TIMEOUT)
    except AssertionError as exc:
        print(f"  {fault}: {str(exc)[:400]}", file=sys.stderr)
        seconds = None
    counts = tally(stack, ids)
    _replace_dead_workers(stack)
    return {"fault": fault, **counts, "seconds_to_last_end": None if seconds is None else round(seconds, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--outage-seconds", type=float, default=20.0)
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")

    model = ensure_model("tiny")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rein-chaos-") as tmp:
        root = Path(tmp)
        redis, postgres = RedisServer(root / "redis"), PostgresCluster()
        redis.start()
        try:
            postgres.create()
            with run_service(root, model, postgres_url=postgres.url, redis_url=redis.url, workers=2,
                             extra_env={"REIN_MAX_NUM_SEQS": str(args.max_num_seqs)}) as service:
                stack = Stack(service, redis, postgres)
                for fault in faults:
                    row = run_fault(stack, fault, args)
                    print(f"  {fault}: {row}", file=sys.stderr)
                    rows.append(row)
        finally:
            redis.stop()
            postgres.destroy()

    print(f"\n{args.jobs} greedy jobs of {args.max_tokens} tokens in flight on two workers "
          f"(max_num_seqs {args.max_num_seqs}), default lease and reaper settings\n")
    print("| fault | accepted | ended | lost | billed twice | s to last job's end |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        what = WHAT[row["fault"]].format(s=f"{args.outage_seconds:g}")
        print(f"| {what} | {row['accepted']} | {row['ended']} | {row['lost']} | {row['billed_twice']} | "
              f"{row['seconds_to_last_end']} |")
    print(json.dumps({"jobs": args.jobs, "max_tokens": args.max_tokens, "faults": rows}))
    return 0 if all(row["lost"] == 0 and row["billed_twice"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
