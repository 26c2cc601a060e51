"""`rein worker --devices cpu,cpu`: two engines, each a worker process of its own under one
supervisor, consuming one model's queue on real Redis and Postgres.

All jobs end and both engines ran some (each job's `worker` column names its engine's node);
a child SIGKILLed mid-job is started again, and its jobs end once, through the lease and the
reaper; SIGTERM stops both engines' workers warmly and the command exits 0.

The command runs on a database and Redis prefix of its own: its workers run the reaper, which
must not send the other tests' jobs again.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import support
from sqlalchemy import func, select
from sqlalchemy.orm import sessionmaker

from rein.core.priorities import PRIORITY_INTERACTIVE
from rein.core.settings import Settings
from rein.store.messages import JobMessage
from rein.store.redis_keys import RedisKeys
from rein.store.tables import ApiKey, Job, Usage

MODEL = "tiny"
START_TIMEOUT = 180.0   # two workers import torch and load an engine each, on a busy machine
WAIT = 120.0
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Engines:
    process: subprocess.Popen
    names: list[str]
    settings: Settings
    sessions: sessionmaker
    keys: RedisKeys
    redis: object
    log: Path

    def child_pids(self) -> dict[str, int]:
        """Node name -> pid of each engine's worker process now running."""
        pids = {}
        for child in psutil.Process(self.process.pid).children():
            try:
                cmdline = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            pids.update({name: child.pid for name in self.names if name in cmdline})
        return pids

    def beat(self, name: str) -> dict | None:
        raw = self.redis.get(self.keys.worker_heartbeat(name))
        return json.loads(raw) if raw else None

    def diagnostics(self) -> str:
        return "\n--- supervisor log ---\n" + "\n".join(self.log.read_text(errors="replace").splitlines()[-60:])


@pytest.fixture(scope="module")
def engines(make_database, redis_url, tiny_models, tmp_path_factory) -> Iterator[Engines]:
    import redis

    from rein.store.db import make_engine
    from rein.store.migrate import upgrade

    database_url = make_database()
    prefix = f"rein_test_dp_{secrets.token_hex(4)}"
    settings = Settings(database_url=database_url, redis_url=redis_url, redis_key_prefix=prefix)
    upgrade(settings)
    host = f"dp-{secrets.token_hex(3)}"
    log = tmp_path_factory.mktemp("devices") / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REIN_")} | {
        "REIN_DATABASE_URL": database_url, "REIN_REDIS_URL": redis_url, "REIN_REDIS_KEY_PREFIX": prefix,
        "REIN_MODELS": f"{MODEL}={tiny_models('llama')}@1024", "REIN_KV_CACHE_MEMORY": "16MiB",
        "REIN_MAX_NUM_SEQS": "2", "REIN_WORKER_ENGINE_PROCESS": "false",
        # A killed engine's jobs come back within seconds, not the default half minute.
        "REIN_LEASE_SECONDS": "4", "REIN_LEASE_RENEW_SECONDS": "1", "REIN_REAPER_INTERVAL_SECONDS": "1",
        "REIN_REQUEUE_UNCLAIMED_SECONDS": "3",
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    client = redis.Redis.from_url(redis_url)
    db = make_engine(database_url)
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "rein.cli.main", "worker", "--devices", "cpu,cpu",
                                    "--hostname", host], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    engines = Engines(process, [f"{MODEL}-cpu0@{host}", f"{MODEL}-cpu1@{host}"], settings,
                      sessionmaker(db, expire_on_commit=False), RedisKeys.from_settings(settings), client, log)
    try:
        def both_up() -> bool:
            if process.poll() is not None:
                raise AssertionError(f"the worker command exited with {process.returncode}{engines.diagnostics()}")
            return all((engines.beat(name) or {}).get("state") == "up" for name in engines.names)

        try:
            support.wait_for(both_up, START_TIMEOUT, "both engines' heartbeats up")
        except AssertionError as exc:
            raise AssertionError(f"{exc}{engines.diagnostics()}") from None
        yield engines
    finally:
        if process.poll() is None:
            process.kill()   # the supervisor's children get SIGTERM as it dies (PR_SET_PDEATHSIG)
            process.wait(30)
        db.dispose()
        support.delete_prefixed(client, prefix + ":")
        client.close()


def enqueue(engines: Engines, count: int, max_tokens: int) -> list[str]:
    from rein.jobs.queues import enqueue_jobs
    from rein.worker.app import make_worker_celery

    tenant, key_id = f"t-{secrets.token_hex(4)}", f"k{secrets.token_hex(6)}"
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    jobs = [Job(tenant=tenant, key_id=key_id, model=MODEL, endpoint="/v1/completions",
                params={"body": {}, "sampling": sampling}, prompt_token_ids=[5, 6, 7, 8 + i], prompt_tokens=4,
                priority=PRIORITY_INTERACTIVE, sent_at=func.now()) for i in range(count)]
    with engines.sessions.begin() as session:
        session.add(ApiKey(key_id=key_id, name="test", tenant=tenant, secret_hash=b"x" * 32, scopes=["inference"]))
        session.flush()
        session.add_all(jobs)
    enqueue_jobs(make_worker_celery(engines.settings), [
        JobMessage(job_id=job.id, model=MODEL, endpoint="/v1/completions", prompt_token_ids=job.prompt_token_ids,
                   sampling=sampling, priority=PRIORITY_INTERACTIVE, tenant=tenant, key_id=key_id) for job in jobs])
    return [job.id for job in jobs]


def rows(engines: Engines, job_ids: list[str]) -> list[Job]:
    with engines.sessions() as session:
        return list(session.scalars(select(Job).where(Job.id.in_(job_ids))))


def wait_all_ended(engines: Engines, job_ids: list[str]) -> list[Job]:
    def ended() -> list[Job] | None:
        found = rows(engines, job_ids)
        return found if all(job.status in ("succeeded", "failed", "cancelled") for job in found) else None

    try:
        return support.wait_for(ended, WAIT, "every job ended")
    except AssertionError as exc:
        raise AssertionError(f"{exc}{engines.diagnostics()}") from None


def usage_counts(engines: Engines, job_ids: list[str]) -> dict[str, int]:
    with engines.sessions() as session:
        return dict(session.execute(select(Usage.job_id, func.count()).where(Usage.job_id.in_(job_ids))
                                    .group_by(Usage.job_id)).all())


def test_both_engines_take_jobs_from_one_queue(engines):
    job_ids = enqueue(engines, 10, max_tokens=24)
    jobs = wait_all_ended(engines, job_ids)
    assert {job.status for job in jobs} == {"succeeded"}, [(job.id, job.status, job.error) for job in jobs]
    assert {job.worker for job in jobs} == set(engines.names)
    assert usage_counts(engines, job_ids) == dict.fromkeys(job_ids, 1)
    assert {engines.beat(name)["model"] for name in engines.names} == {MODEL}


def test_a_killed_engine_worker_is_started_again_and_its_jobs_end_once(engines):
    pids = engines.child_pids()
    assert set(pids) == set(engines.names)
    victim = engines.names[1]
    job_ids = enqueue(engines, 6, max_tokens=400)

    def running_on_victim() -> bool:
        return any(job.status == "running" and job.worker == victim for job in rows(engines, job_ids))

    support.wait_for(running_on_victim, WAIT, f"a job running on {victim}", interval=0.05)
    killed_at = time.time()
    os.kill(pids[victim], signal.SIGKILL)
    jobs = wait_all_ended(engines, job_ids)
    assert {job.status for job in jobs} == {"succeeded"}, [(job.id, job.status, job.error) for job in jobs]
    # The job it was running came back through its lease, refunded, and no death is counted
    # against it (a worker gone whole is no evidence: rein.worker.suspects).
    assert any(job.attempts_refunded for job in jobs) and not any(job.deaths_seen for job in jobs)
    assert usage_counts(engines, job_ids) == dict.fromkeys(job_ids, 1)   # billed once each
    # The supervisor started the victim's worker again: a new process, beating with its engine up.
    support.wait_for(lambda: (engines.beat(victim) or {}).get("state") == "up"
                     and engines.beat(victim)["started"] > killed_at, WAIT, f"{victim} up again")
    assert engines.child_pids().get(victim) not in (None, pids[victim])
    assert engines.child_pids()[engines.names[0]] == pids[engines.names[0]]
    assert "died after" in engines.log.read_text() and "(device cpu)" in engines.log.read_text()


def test_sigterm_stops_both_engine_workers_and_the_command(engines):
    children = [psutil.Process(pid) for pid in engines.child_pids().values()]
    assert len(children) == 2
    engines.process.send_signal(signal.SIGTERM)
    assert engines.process.wait(60) == 0, engines.diagnostics()
    assert not any(child.is_running() and child.status() != psutil.STATUS_ZOMBIE for child in children)
    registry = engines.redis.hgetall(engines.keys.workers())
    assert {json.loads(registry[name.encode()])["state"] for name in engines.names} == {"stopped"}
