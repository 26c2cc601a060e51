"""Batch input limits against real Postgres and Redis, with the batch manager running in the app:
a line past REIN_MAX_REQUEST_BYTES fails its batch with the line named and is never held whole;
a validation that kills its process is tried again once, then fails its batch instead of
crash-looping; and a tenant at REIN_MAX_QUEUED_BATCH_TOKENS_PER_TENANT is held back while
another tenant's lines go on."""

from __future__ import annotations

import io
import json
import time
import tracemalloc

import pytest
from api_support import auth, jsonl, line
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import select
from support import wait_for

from rein.core.priorities import PRIORITY_BATCH
from rein.jobs.queues import priority_lists
from rein.store.tables import Batch, Job

FAST = {"batch_poll_seconds": 0.05}

pytestmark = pytest.mark.usefixtures("end_leftover_batches")


def create(client, key: str, content: bytes) -> dict:
    upload = client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                         files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")})
    assert upload.status_code == 200, upload.text
    response = client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 200, response.text
    return response.json()


def wait_status(client, key: str, batch_id: str, *statuses: str, timeout: float = 60) -> dict:
    def reached():
        batch = client.get(f"/v1/batches/{batch_id}", headers=auth(key)).json()
        return batch if batch["status"] in statuses else None

    return wait_for(reached, timeout, f"batch {batch_id} to reach {statuses}")


def sent_jobs(sessions, batch_id: str) -> list[Job]:
    with sessions() as session:
        return list(session.scalars(select(Job).where(Job.batch_id == batch_id, Job.sent_at.is_not(None))))


def test_a_20_mb_line_fails_its_batch_unread_and_the_api_lives(make_client, make_key, tenant, tmp_path,
                                                               db_sessionmaker):
    """A 20 MB line under the default 16 MiB REIN_MAX_REQUEST_BYTES: the batch fails naming the line,
    its size and the limit, the lines around it are still checked, and the validation never
    held the line whole (nor parsed it, which takes about 25 times its bytes)."""
    client = make_client(files_dir=str(tmp_path / "files"), **FAST)
    cap = client.app.state.settings.max_request_bytes
    key = make_key(tenant, "batch")
    # Numbers, so that parsing it (were it read) would cost some 100 MB, not a string's 20.
    long_line = json.dumps({**line("long"), "pad": [0] * 10_000_000}, separators=(",", ":"))
    assert len(long_line) > 20_000_000 > cap
    content = jsonl(line("a"), long_line, line("b", model="nope"))
    del long_line
    tracemalloc.start()
    try:
        batch = create(client, key, content)
        upload_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        done = wait_status(client, key, batch["id"], "failed", "in_progress")
        validation_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert done["status"] == "failed"
    errors = done["errors"]["data"]
    assert [(e["line"], e["code"]) for e in errors] == [(2, "line_too_large"), (3, "model_not_found")]
    size = len(content) - len(jsonl(line("a"), line("b", model="nope"))) - 1
    assert errors[0]["message"].startswith(f"line 2: the line is {size} bytes, over the limit of {cap} bytes")
    assert "REIN_MAX_REQUEST_BYTES" in errors[0]["message"]
    print(f"validation peak {validation_peak / 2**20:.2f} MiB")
    # Measured a chunk at a time, never held: a small fraction of the line (and of the cap).
    assert validation_peak < size / 4, (f"validation peak {validation_peak / 2**20:.0f} MiB for a {size / 2**20:.0f} "
                                    f"MiB line (upload: {upload_peak / 2**20:.0f} MiB)")
    assert client.get("/healthz").status_code == 200
    assert create(client, key, jsonl(line("after")))["status"] == "validating"     # and it goes on serving


def validation_starts(sessions, batch_id: str) -> int:
    with sessions() as session:
        return session.scalar(select(Batch.validation_starts).where(Batch.id == batch_id))


class ProcessDied(BaseException):
    """Stands for the OOM killer: nothing after it runs in the validating code (a BaseException,
    so no `except Exception` of the manager's sees it, as none sees a SIGKILL)."""


def test_a_validation_that_kills_its_process_is_tried_twice_then_fails(make_client, make_key, tenant, tmp_path,
                                                                       db_sessionmaker, monkeypatch):
    """Each start is counted in Postgres before the file is read; the third manager to pick the
    batch up finds two starts that never ended and fails it with the reason, instead of dying
    too. Another tenant's batch validates meanwhile."""
    import rein.batches.manager as manager

    real = manager.validate_lines
    starts_seen = []

    def dies_on_the_bomb(lines, *args, **kwargs):
        lines = iter(lines)
        first = next(lines)
        if b"bomb" in first:
            with db_sessionmaker() as session:     # what a restarted process will find
                starts_seen.append(session.scalar(select(Batch.validation_starts)
                                                  .where(Batch.status == "validating", Batch.tenant == tenant)))
            raise ProcessDied
        return real([first, *lines], *args, **kwargs)

    monkeypatch.setattr(manager, "validate_lines", dies_on_the_bomb)
    client = make_client(files_dir=str(tmp_path / "files"), **FAST)
    key, other_key = make_key(tenant, "batch"), make_key(f"{tenant}-other", "batch")
    bomb = create(client, key, jsonl(line("bomb"), line("b")))
    healthy = create(client, other_key, jsonl(line("a"), line("b")))
    failed = wait_status(client, key, bomb["id"], "failed")
    assert starts_seen == [1, 2]                     # committed before the work, once per start
    [error] = failed["errors"]["data"]
    assert error["code"] == "validation_crashed"
    assert error["message"].startswith("validation of this batch was started 2 times and its process died "
                                       "each time")
    assert "Split the input file" in error["message"]
    assert wait_status(client, other_key, healthy["id"], "in_progress")
    assert validation_starts(db_sessionmaker, healthy["id"]) == 1


def test_a_validation_stopped_by_an_outage_is_not_counted_as_a_death(make_client, make_key, tenant, tmp_path,
                                                                     db_sessionmaker, monkeypatch):
    """Three validations stopped by Redis being away (the process alive to see it) take their
    start back: the fourth goes through rather than the batch failing as a crash loop."""
    import rein.batches.manager as manager

    real = manager.validate_lines
    calls = []

    def redis_away_three_times(*args, **kwargs):
        calls.append(1)
        if len(calls) <= 3:
            raise RedisConnectionError("Redis is away")
        return real(*args, **kwargs)

    monkeypatch.setattr(manager, "validate_lines", redis_away_three_times)
    client = make_client(files_dir=str(tmp_path / "files"), **FAST)
    key = make_key(tenant, "batch")
    batch = create(client, key, jsonl(line("a"), line("b")))
    assert wait_status(client, key, batch["id"], "in_progress", "failed")["status"] == "in_progress"
    assert len(calls) == 4 and validation_starts(db_sessionmaker, batch["id"]) == 1


def test_a_tenant_at_its_queued_batch_token_cap_is_held_back_while_another_goes_on(
        make_client, make_key, tenant, tmp_path, db_sessionmaker, fake_worker, redis_client, settings):
    """Lines of 100 + a few tokens (max_tokens 100, a short prompt) under a cap of 250 per tenant:
    three of a tenant's lines are sent (the third passes the cap), however much room the queue
    window has; the next goes once one of them finishes. Another tenant's batch is fed meanwhile."""
    client = make_client(files_dir=str(tmp_path / "files"), batch_queue_window=20,
                         max_queued_batch_tokens_per_tenant=250, **FAST)
    big_key, small_key = make_key(tenant, "batch"), make_key(f"{tenant}-small", "batch")
    big = create(client, big_key, jsonl(*(line(f"r{i}", max_tokens=100) for i in range(12))))
    wait_status(client, big_key, big["id"], "in_progress")
    wait_for(lambda: len(sent_jobs(db_sessionmaker, big["id"])) == 3, 30, "three lines sent")
    jobs = sent_jobs(db_sessionmaker, big["id"])
    assert all(100 < job.requested_tokens < 125 and job.requested_tokens == job.prompt_tokens + 100
               for job in jobs)
    small = create(client, small_key, jsonl(*(line(f"s{i}", max_tokens=100) for i in range(2))))
    wait_status(client, small_key, small["id"], "in_progress")
    wait_for(lambda: len(sent_jobs(db_sessionmaker, small["id"])) == 2, 30, "the other tenant's lines sent")
    time.sleep(0.5)                                  # ticks enough to send more, were the cap not there
    assert len(sent_jobs(db_sessionmaker, big["id"])) == 3
    waiting = sum(redis_client.llen(key) for key in priority_lists(settings, "tiny", PRIORITY_BATCH))
    assert waiting >= 5                          # (room left in the window; every batch shard's list)
    fake_worker.record(jobs[0].id, "done", [5])      # one finishes: one more goes
    wait_for(lambda: len(sent_jobs(db_sessionmaker, big["id"])) == 4, 30, "a fourth line sent")
    time.sleep(0.5)
    assert len(sent_jobs(db_sessionmaker, big["id"])) == 4


# What a process run by the test does: validate one batch with a manager of its own, and be
# SIGKILLed (as by the OOM killer) when the file is read.
KILLED_VALIDATION = """
import os, signal, sys
from redis import Redis
from sqlalchemy.orm import sessionmaker
import rein.batches.manager as manager
from rein.store.db import make_engine
from rein.store.filestore import LocalFileStore
from rein.core.settings import Settings
from rein.jobs.queues import make_celery
from rein.jobs.registry import ModelRegistry

settings = Settings.model_validate_json(sys.argv[1])
manager.validate_lines = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
sessions = sessionmaker(make_engine(settings.database_url), expire_on_commit=False)
manager.BatchManager(settings, sessions, Redis.from_url(settings.redis_url), make_celery(settings),
                     ModelRegistry.load(settings), LocalFileStore(settings.files_dir)).advance(sys.argv[2])
"""


def test_validations_killed_by_sigkill_leave_their_starts_and_the_next_manager_fails_the_batch(
        make_settings, model_dir, make_key, tenant, tmp_path, db_sessionmaker, redis_client):
    """Real processes, really killed while validating: each leaves its start counted in Postgres
    and the batch `validating` (its advisory lock gone with its connection); after two, a manager
    fails the batch instead of validating it."""
    import subprocess
    import sys
    from datetime import timedelta

    from sqlalchemy import func

    from rein.batches.manager import BatchManager
    from rein.jobs.queues import make_celery
    from rein.jobs.registry import ModelRegistry
    from rein.store.filestore import LocalFileStore
    from rein.store.keys import parse_key
    from rein.store.tables import File

    settings = make_settings(models=f"tiny={model_dir}@512", files_dir=str(tmp_path / "files"))
    store = LocalFileStore(settings.files_dir)
    key_id = parse_key(make_key(tenant, "batch"))[0]
    file_id = f"file-{tenant}"
    with db_sessionmaker.begin() as session:
        session.add(File(id=file_id, tenant=tenant, key_id=key_id, filename="in.jsonl", purpose="batch",
                         bytes=store.save(file_id, [jsonl(line("a"))])))
        batch = Batch(tenant=tenant, key_id=key_id, endpoint="/v1/completions", input_file_id=file_id,
                      completion_window="24h", expires_at=func.now() + timedelta(days=1))
        session.add(batch)
    for death in (1, 2):
        run = subprocess.run([sys.executable, "-c", KILLED_VALIDATION, settings.model_dump_json(), batch.id],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == -9, run.stderr[-2000:]
        with db_sessionmaker() as session:
            row = session.get(Batch, batch.id)
            assert (row.status, row.validation_starts) == ("validating", death)
    manager = BatchManager(settings, db_sessionmaker, redis_client, make_celery(settings),
                           ModelRegistry.load(settings), store)
    manager.advance(batch.id)
    with db_sessionmaker() as session:
        row = session.get(Batch, batch.id)
        assert row.status == "failed" and row.failed_at is not None
        [error] = row.errors["data"]
    assert error["code"] == "validation_crashed"
    assert error["message"].startswith("validation of this batch was started 2 times and its process died")
