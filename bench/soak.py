"""Soak: a steady load while a random fault strikes every few seconds; every accepted job must
end `succeeded`.

    python bench/soak.py [--minutes 10] [--fault-every 20] [--seed 0]
                         [--faults worker,engine,api,redis-aof,redis-empty,postgres]

A stack of its own (as bench/chaos.py): a `redis-server` with an append-only file and a
Postgres cluster on free loopback ports in a temp dir, `rein api` and two `rein worker`s on the
tiny random-weight llama. For `--minutes`, three loads run side by side:

* async jobs: a completion of 48 tokens every 0.25 s (POST /v1/jobs);
* streamed chats: one after another, `stream: true` on /v1/chat/completions;
* one batch of 120 completion lines, created at the start.

Every `--fault-every` seconds one fault, each kind once per round in an order drawn with `--seed`:

* worker: SIGKILL one worker (a new one is started, as a supervisor would);
* engine: SIGKILL the engine process of one worker whose engine is up (the worker replaces it;
  one killed while its worker still starts ends that worker, which is then started again);
* api: SIGKILL `rein api` and start it again;
* redis-aof: SIGKILL redis-server and start it again on its append-only file;
* redis-empty: SIGKILL redis-server and start it again with no data (its AOF deleted);
* postgres: crash Postgres (`pg_ctl stop -m immediate`), start it again 10 s later.

Then the load stops and the soak waits for every accepted job and the batch to end. It
prints: jobs accepted, succeeded, failed, failed as poison (`crashes_its_worker`: a job the
engine deaths isolated as their cause, rein.worker.suspects; the soak sends none, so must be 0),
lost (not ended), billed twice, batch lines failed, HTTP 500s, streams cut by an API kill (a
connection to a killed process cannot end cleanly), streams cut otherwise (must be 0), the
seconds to drain, the longest and the 99th percentile of the jobs' and lines' times from
queued to finished, and the most of them still queued or running at the moments the load
stopped and 60 s later. The last line of stdout is one
JSON object with the figures; the exit status is 0 when every job and line succeeded, nothing
was lost or billed twice and no 500 was answered. tests/e2e/test_soak.py runs a 2-minute soak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e"), str(Path(__file__).resolve().parent)]

import httpx  # noqa: E402
from chaos_support import Stack, tally, wait_ready  # noqa: E402
from e2e_support import MODEL, run_service  # noqa: E402
from own_servers import PostgresCluster, RedisServer  # noqa: E402

FAULTS = ("worker", "engine", "api", "redis-aof", "redis-empty", "postgres")
POSTGRES_OUTAGE_SECONDS = 10.0
DRAIN_TIMEOUT = 900.0
BATCH_LINES = 120
JOB_EVERY_SECONDS = 0.25


@dataclass
class Figures:
    accepted: list[str] = field(default_factory=list)
    http_500: int = 0
    refused: int = 0                  # 503s and refused connections while a server was away: retried
    streams_done: int = 0
    streams_error_event: int = 0
    streams_cut_by_api_kill: int = 0
    streams_cut_otherwise: int = 0
    faults: list[str] = field(default_factory=list)
    workers_restarted: int = 0        # workers that exited by themselves, started again as a supervisor would
    api_kills: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Soak:
    def __init__(self, stack: Stack, args: argparse.Namespace, log=print) -> None:
        self.stack, self.args, self.log = stack, args, log
        self.figures = Figures()
        self.stop = threading.Event()
        self.random = random.Random(args.seed)
        self.batch_id: str | None = None
        self.left_at_stop: int | None = None
        # Each worker's log (its engine is up once it says so): the first two are run_service's.
        self.worker_logs = {proc.pid: stack.service.logs / ("worker.log" if n == 0 else f"worker{n}.log")
                            for n, proc in enumerate(stack.service.workers)}
        self.left_after_60s: int | None = None

    # -- load ----------------------------------------------------------------------------------

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return self.stack.service.client("a", timeout=timeout)

    def _count(self, response: httpx.Response) -> None:
        if response.status_code >= 500 and response.status_code != 503:
            with self.figures.lock:
                self.figures.http_500 += 1
            self.log(f"soak: HTTP {response.status_code}: {response.text[:300]}")

    def submit_jobs(self) -> None:
        i = 0
        with self.client() as client:
            while not self.stop.wait(JOB_EVERY_SECONDS):
                i += 1
                body = {"model": MODEL, "prompt": f"Soak job {i}:", "max_tokens": 48, "temperature": 0.0,
                        "ignore_eos": True}
                try:
                    response = client.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": body})
                except httpx.HTTPError:
                    self.figures.refused += 1
                    continue
                self._count(response)
                if response.status_code == 202:
                    with self.figures.lock:
                        self.figures.accepted.append(response.json()["id"])
                else:
                    self.figures.refused += 1

    def stream_chats(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Chat {i}"}], "max_tokens": 24,
                    "temperature": 0.0, "stream": True}
            started = time.monotonic()
            outcome = "refused"   # until the response's headers arrive: a refused connection is retried
            try:
                with self.client(timeout=120) as client, client.stream("POST", "/v1/chat/completions",
                                                                        json=body) as response:
                    self._count(response)
                    if response.status_code != 200:
                        outcome = "refused"
                    else:
                        outcome = "cut"
                        for line in response.iter_lines():
                            if line.strip() == "data: [DONE]":
                                outcome = "done"
                            elif line.startswith("data:") and '"error"' in line:
                                outcome = "error"
            except httpx.HTTPError:
                pass
            if outcome == "refused":
                self.figures.refused += 1
                self.stop.wait(0.5)
                continue
            with self.figures.lock:
                if outcome == "done":
                    self.figures.streams_done += 1
                elif outcome == "error":
                    self.figures.streams_error_event += 1
                elif any(kill >= started for kill in self.figures.api_kills):
                    self.figures.streams_cut_by_api_kill += 1
                else:
                    self.figures.streams_cut_otherwise += 1
                    self.log(f"soak: a stream was cut without an error event (chat {i})")

    def start_batch(self) -> None:
        content = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                      "body": {"model": MODEL, "prompt": f"Batch line {i}:", "max_tokens": 32,
                                               "temperature": 0.0, "ignore_eos": True}}) + "\n"
                          for i in range(BATCH_LINES)).encode()
        with self.client() as client:
            upload = client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("soak.jsonl", content)})
            upload.raise_for_status()
            batch = client.post("/v1/batches", json={"input_file_id": upload.json()["id"],
                                                     "endpoint": "/v1/completions", "completion_window": "24h"})
            batch.raise_for_status()
            self.batch_id = batch.json()["id"]

    # -- faults --------------------------------------------------------------------------------

    def inject_faults(self) -> None:
        faults = [f.strip() for f in self.args.faults.split(",") if f.strip()]
        deck: list[str] = []
        while not self.stop.wait(self.args.fault_every):
            restarted = self._replace_dead_workers()
            if restarted:
                self.figures.workers_restarted += restarted
                self.log(f"soak: {restarted} worker(s) had exited by themselves; started again")
            if not deck:   # every kind once, in a seeded order, before any comes again
                deck = self.random.sample(faults, len(faults))
            fault = deck.pop()
            at = time.monotonic()
            try:
                getattr(self, "_" + fault.replace("-", "_"))()
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported
                self.log(f"soak: fault {fault} could not be injected: {exc}")
                fault += " (not injected)"
            self.figures.faults.append(fault)
            self.log(f"soak: {time.strftime('%H:%M:%S')} {fault} ({time.monotonic() - at:.1f} s)")

    def _worker(self) -> None:
        service = self.stack.service
        victim = self.random.choice([p for p in service.workers if p.poll() is None])
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
        service.workers.remove(victim)
        self._spawn_worker()

    def _spawn_worker(self) -> None:
        name = f"soak-worker-{time.monotonic_ns()}@localhost"
        worker = self.stack.service.spawn(name, "worker", "--model", MODEL, "--hostname", name)
        self.stack.service.workers.append(worker)
        self.worker_logs[worker.pid] = self.stack.service.logs / f"{name}.log"

    def _engine_up(self, worker) -> bool:
        log = self.worker_logs.get(worker.pid)
        return worker.poll() is None and log is not None and b"engine ready for" in log.read_bytes()

    def _engine(self) -> None:
        service = self.stack.service
        ready = [p for p in service.workers if self._engine_up(p)]
        if not ready:
            raise RuntimeError("no worker has its engine up (all still starting)")
        worker = self.random.choice(ready)
        children = engine_processes(worker.pid)
        if not children:
            raise RuntimeError(f"worker {worker.pid} has no engine process (still starting?)")
        os.kill(children[0], signal.SIGKILL)

    def _api(self) -> None:
        service = self.stack.service
        with self.figures.lock:
            self.figures.api_kills.append(time.monotonic())
        service.api.send_signal(signal.SIGKILL)
        service.api.wait(10)
        service.api = service.spawn(f"api-{time.monotonic_ns()}", "api")

    def _redis_aof(self) -> None:
        self.stack.redis.kill()
        self.stack.redis.start()

    def _redis_empty(self) -> None:
        self.stack.redis.kill()
        for path in self.stack.redis.directory.iterdir():
            if path.name.startswith("appendonly") or path.suffix == ".rdb":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.stack.redis.start()

    def _postgres(self) -> None:
        self.stack.postgres.stop("immediate")
        self.stop.wait(POSTGRES_OUTAGE_SECONDS)
        self.stack.postgres.start()

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> dict:
        self.start_batch()
        threads = [threading.Thread(target=target, name=name, daemon=True) for name, target in
                   (("jobs", self.submit_jobs), ("chats", self.stream_chats), ("faults", self.inject_faults))]
        for thread in threads:
            thread.start()
        self.stop.wait(self.args.minutes * 60)
        self.stop.set()
        for thread in threads:
            thread.join(120)
        stopped = time.monotonic()
        self._replace_dead_workers()
        self.left_at_stop = self._left()
        wait_ready(self.stack.service, 300)
        drained = self._drain(stopped)
        return self._report(drained)

    def _left(self) -> int | None:
        """Accepted jobs and batch lines not ended yet (None while Postgres cannot be read)."""
        try:
            with self.stack.db() as conn:
                return conn.execute("SELECT count(*) FROM jobs WHERE (id = ANY(%s) OR batch_id = %s) AND status "
                                    "IN ('queued', 'running')", (self.figures.accepted, self.batch_id)).fetchone()[0]
        except Exception:  # noqa: BLE001 - Postgres may be restarting
            return None

    def _replace_dead_workers(self) -> int:
        service = self.stack.service
        dead = [p for p in service.workers if p.poll() is not None]
        for proc in dead:
            service.workers.remove(proc)
            self._spawn_worker()
        return len(dead)

    def _ended(self) -> bool:
        with self.stack.db() as conn:
            left = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status NOT IN "
                                "('succeeded', 'failed', 'cancelled')", (self.figures.accepted,)).fetchone()[0]
            batch = conn.execute("SELECT status FROM batches WHERE id = %s", (self.batch_id,)).fetchone()[0]
        return left == 0 and batch in ("completed", "failed", "expired", "cancelled")

    def _drain(self, since: float) -> float | None:
        deadline = since + DRAIN_TIMEOUT
        while time.monotonic() < deadline:
            if self.left_after_60s is None and time.monotonic() - since >= 60:
                self.left_after_60s = self._left()
            try:
                if self._ended():
                    if self.left_after_60s is None:
                        self.left_after_60s = 0
                    return time.monotonic() - since
            except Exception:  # noqa: BLE001 - Postgres may still be starting
                pass
            time.sleep(1)
        return None

    def _report(self, drained: float | None) -> dict:
        counts = tally(self.stack, self.figures.accepted)
        with self.stack.db() as conn:
            failed = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s) AND status = 'failed'",
                                  (self.figures.accepted,)).fetchone()[0]
            failures = conn.execute("SELECT error->>'code', count(*) FROM jobs WHERE (id = ANY(%s) OR batch_id = %s) "
                                    "AND status = 'failed' GROUP BY 1", (self.figures.accepted, self.batch_id)).fetchall()
            batch_status, lines = conn.execute("SELECT status, request_total FROM batches WHERE id = %s",
                                               (self.batch_id,)).fetchone()
            by_status = dict(conn.execute("SELECT status, count(*) FROM jobs WHERE batch_id = %s GROUP BY status",
                                          (self.batch_id,)).fetchall())
            job_seconds = conn.execute(
                "SELECT max(s), percentile_cont(0.99) WITHIN GROUP (ORDER BY s) FROM (SELECT extract(epoch FROM "
                "finished_at - queued_at) AS s FROM jobs WHERE (id = ANY(%s) OR batch_id = %s) "
                "AND finished_at IS NOT NULL) t", (self.figures.accepted, self.batch_id)).fetchone()
        f = self.figures
        return {"minutes": self.args.minutes, "fault_every": self.args.fault_every, "seed": self.args.seed,
                "faults": f.faults, "accepted": counts["accepted"], "succeeded": counts["succeeded"], "failed": failed,
                "lost": counts["accepted"] - counts["ended"], "billed_twice": counts["billed_twice"],
                "failure_codes": dict(failures), "failed_as_poison": dict(failures).get("crashes_its_worker", 0),
                "batch_status": batch_status, "batch_lines": lines,
                "batch_lines_succeeded": by_status.get("succeeded", 0),
                "batch_lines_failed": lines - by_status.get("succeeded", 0), "http_500": f.http_500,
                "refused_and_retried": f.refused, "streams_done": f.streams_done,
                "streams_error_event": f.streams_error_event, "streams_cut_by_api_kill": f.streams_cut_by_api_kill,
                "streams_cut_otherwise": f.streams_cut_otherwise, "workers_restarted": f.workers_restarted,
                "drain_seconds": None if drained is None else round(drained, 1),
                "job_seconds_max": None if job_seconds[0] is None else round(float(job_seconds[0]), 1),
                "job_seconds_p99": None if job_seconds[1] is None else round(float(job_seconds[1]), 1),
                "left_at_stop": self.left_at_stop, "left_after_60s": self.left_after_60s}


def engine_processes(worker_pid: int) -> list[int]:
    """The worker's engine child (multiprocessing spawn), by /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != worker_pid:
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def passed(report: dict) -> bool:
    return (report["succeeded"] == report["accepted"] and report["lost"] == 0 and report["billed_twice"] == 0
            and report["batch_lines_failed"] == 0 and report["batch_status"] == "completed"
            and report["http_500"] == 0 and report["streams_cut_otherwise"] == 0
            and report["drain_seconds"] is not None)


def soak(args: argparse.Namespace, model_dir: Path, log=print) -> dict:
    with tempfile.TemporaryDirectory(prefix="rein-soak-") as tmp:
        root = Path(tmp)
        redis, postgres = RedisServer(root / "redis", aof=True), PostgresCluster()
        redis.start()
        try:
            postgres.create()
            env = {"REIN_FILES_DIR": str(root / "files"), "REIN_BATCH_POLL_SECONDS": "0.5",
                   "REIN_MAX_NUM_SEQS": "16"}
            with run_service(root, model_dir, postgres_url=postgres.url, redis_url=redis.url, workers=2,
                             scopes="inference,batch,usage", extra_env=env) as service:
                return Soak(Stack(service, redis, postgres), args, log).run()
        finally:
            redis.stop()
            postgres.destroy()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fault-every", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default=",".join(FAULTS))
    args = parser.parse_args(argv)
    unknown = {f.strip() for f in args.faults.split(",") if f.strip()} - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    return args


def main() -> int:
    from intake import ensure_model

    args = parse_args()
    report = soak(args, ensure_model("tiny"), log=lambda line: print(line, file=sys.stderr))
    print(f"\nsoak: {args.minutes:g} min, a fault every {args.fault_every:g} s (seed {args.seed}): "
          f"{', '.join(report['faults'])}\n")
    for name in ("accepted", "succeeded", "failed", "failed_as_poison", "lost", "billed_twice", "batch_lines",
                 "batch_lines_failed", "http_500", "streams_done", "streams_error_event", "streams_cut_by_api_kill",
                 "streams_cut_otherwise", "workers_restarted", "drain_seconds", "left_at_stop", "left_after_60s", "job_seconds_max",
                 "job_seconds_p99"):
        print(f"  {name:26} {report[name]}")
    if report["failure_codes"]:
        print(f"  failures by code:          {report['failure_codes']}")
    print(json.dumps(report))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
