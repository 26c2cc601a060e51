"""Retention (rein.jobs.retention): job results and usage rows expire after their settings and
files at their expires_at (the input file of a batch still running kept), in bounded batches,
idempotently and safely from several processes at once; and what a tenant stores (results and
output files included) is what its storage quota counts."""

from __future__ import annotations

import threading
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from rein.jobs.retention import RetentionLoop, expire_once, stored_bytes
from rein.store.filestore import LocalFileStore
from rein.store.tables import Batch, File, Job, Result, Usage, new_file_id

# Now: the other tests' rows (the database is shared) are fresh, only this module's are aged.
NOW = datetime.now(UTC)


@pytest.fixture
def store(tmp_path) -> LocalFileStore:
    return LocalFileStore(tmp_path / "files")


def _finished_job(db_sessionmaker, make_job, age_days: float, text: str = "an answer") -> str:
    """A succeeded job whose result, usage row and end are `age_days` old."""
    job_id = make_job().job_id
    at = NOW - timedelta(days=age_days)
    with db_sessionmaker.begin() as session:
        job = session.get(Job, job_id)
        job.status, job.finished_at = "succeeded", at
        session.add(Result(job_id=job_id, text=text, finish_reason="stop", token_ids=[1, 2, 3], created_at=at))
        session.add(Usage(job_id=job_id, tenant=job.tenant, key_id=job.key_id, model=job.model,
                          prompt_tokens=4, completion_tokens=3, created_at=at))
    return job_id


def _output_file(db_sessionmaker, store, tenant: str, key_id: str, age_days: float, size: int = 10,
                 expiry_days: float | None = 7, purpose: str = "batch_output") -> str:
    """A file `age_days` old that expires `expiry_days` after its creation (None: never)."""
    file_id = new_file_id()
    store.save(file_id, [b"x" * size])
    created = NOW - timedelta(days=age_days)
    with db_sessionmaker.begin() as session:
        session.add(File(id=file_id, tenant=tenant, key_id=key_id, filename="out.jsonl", purpose=purpose,
                         bytes=size, created_at=created,
                         expires_at=None if expiry_days is None else created + timedelta(days=expiry_days)))
    return file_id


class CountingStore:
    """The file store, noting each delete."""

    def __init__(self, store: LocalFileStore, deleted: list[str]) -> None:
        self.store, self.deleted = store, deleted

    def delete(self, file_id: str) -> None:
        self.deleted.append(file_id)
        self.store.delete(file_id)


def _key_of(db_sessionmaker, job_id: str) -> str:
    with db_sessionmaker() as session:
        return session.get(Job, job_id).key_id


def test_results_files_and_usage_expire_after_their_retention(make_settings, db_sessionmaker, make_job, tenant,
                                                               store):
    settings = make_settings(result_retention_days=30, usage_retention_days=400, retention_batch=2)
    old = [_finished_job(db_sessionmaker, make_job, 31) for _ in range(5)]      # three batches of 2
    ancient = _finished_job(db_sessionmaker, make_job, 401)
    recent = _finished_job(db_sessionmaker, make_job, 29)
    key_id = _key_of(db_sessionmaker, recent)
    old_file = _output_file(db_sessionmaker, store, tenant, key_id, 8)
    new_file = _output_file(db_sessionmaker, store, tenant, key_id, 6)

    report = expire_once(settings, db_sessionmaker, store, now=NOW)
    # At least these (another test's aged rows may still be there on the shared database).
    assert report.results >= 6 and report.files >= 1 and report.usage >= 1
    with db_sessionmaker() as session:
        assert session.scalars(select(Result.job_id).where(Result.job_id.in_([*old, ancient, recent]))).all() == [
            recent]
        kept_usage = set(session.scalars(select(Usage.job_id).where(Usage.job_id.in_([*old, ancient, recent]))))
        assert kept_usage == {*old, recent}                  # usage outlives the results
        assert session.get(Job, old[0]).status == "succeeded"  # the job itself stays
        assert session.get(File, old_file) is None and session.get(File, new_file) is not None
    assert not store.path(old_file).exists() and store.path(new_file).exists()

    # Idempotent: a second pass finds nothing of this test's left to delete.
    again = expire_once(settings, db_sessionmaker, store, now=NOW)
    assert again.files == 0
    with db_sessionmaker() as session:
        assert session.get(Result, recent) is not None


def test_zero_or_unset_keeps_everything(make_settings, db_sessionmaker, make_job, tenant, store):
    settings = make_settings(result_retention_days=0, usage_retention_days=0)
    job_id = _finished_job(db_sessionmaker, make_job, 5000)
    file_id = _output_file(db_sessionmaker, store, tenant, _key_of(db_sessionmaker, job_id), 5000,
                           expiry_days=None)
    assert not expire_once(settings, db_sessionmaker, store, now=NOW).changed
    with db_sessionmaker() as session:
        assert session.get(Result, job_id) is not None and session.get(File, file_id) is not None
        assert session.scalar(select(func.count()).select_from(Usage).where(Usage.job_id == job_id)) == 1


def test_passes_at_once_from_several_processes_delete_each_row_once(make_settings, db_sessionmaker, make_job,
                                                                     tenant, store):
    settings = make_settings(result_retention_days=30, usage_retention_days=0, retention_batch=3)
    jobs = [_finished_job(db_sessionmaker, make_job, 40) for _ in range(12)]
    key_id = _key_of(db_sessionmaker, jobs[0])
    files = [_output_file(db_sessionmaker, store, tenant, key_id, 40) for _ in range(9)]
    deleted: list[str] = []
    counting = CountingStore(store, deleted)
    errors = []

    def run() -> None:
        try:
            expire_once(settings, db_sessionmaker, counting, now=NOW)
        except Exception as exc:        # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    with db_sessionmaker() as session:
        assert session.scalar(select(func.count()).select_from(Result).where(Result.job_id.in_(jobs))) == 0
        assert session.scalar(select(func.count()).select_from(File).where(File.id.in_(files))) == 0
    assert Counter(file_id for file_id in deleted if file_id in files) == dict.fromkeys(files, 1)   # once each
    assert not any(store.path(file_id).exists() for file_id in files)


def test_stored_bytes_count_uploads_outputs_and_results(db_sessionmaker, make_job, tenant, store):
    job_id = _finished_job(db_sessionmaker, make_job, 1, text="y" * 5000)
    key_id = _key_of(db_sessionmaker, job_id)
    _output_file(db_sessionmaker, store, tenant, key_id, 1, size=700)
    with db_sessionmaker.begin() as session:
        session.add(File(id=new_file_id(), tenant=tenant, key_id=key_id, filename="in.jsonl", purpose="batch",
                         bytes=300))
    with db_sessionmaker() as session:
        used = stored_bytes(session, tenant)
        assert (used.uploads, used.outputs) == (300, 700)
        assert used.results >= 3 * 8        # the row as Postgres stores it (its text compressed)
        assert used.total == 1000 + used.results
        assert stored_bytes(session, f"{tenant}-other").total == 0


def test_retention_loop_runs_in_the_background(make_settings, db_sessionmaker, make_job, store):
    settings = make_settings(result_retention_days=1, usage_retention_days=0, retention_interval_seconds=0.05)
    job_id = _finished_job(db_sessionmaker, make_job, 3)
    loop = RetentionLoop(settings, db_sessionmaker, store).start()
    try:
        deadline = threading.Event()
        for _ in range(100):
            with db_sessionmaker() as session:
                if session.get(Result, job_id) is None:
                    break
            deadline.wait(0.05)
        with db_sessionmaker() as session:
            assert session.get(Result, job_id) is None
    finally:
        loop.stop()


def test_an_unfinished_batch_keeps_its_expired_input_file(make_settings, db_sessionmaker, make_job, tenant, store):
    """An upload past its expires_at is deleted, unless a batch that has not ended reads it:
    that one goes with the first sweep after the batch ends."""
    settings = make_settings(result_retention_days=0, usage_retention_days=0)
    key_id = _key_of(db_sessionmaker, make_job().job_id)
    loose = _output_file(db_sessionmaker, store, tenant, key_id, 2, expiry_days=1, purpose="batch")
    held = _output_file(db_sessionmaker, store, tenant, key_id, 2, expiry_days=1, purpose="batch")
    with db_sessionmaker.begin() as session:
        batch = Batch(tenant=tenant, key_id=key_id, endpoint="/v1/completions", input_file_id=held,
                      completion_window="24h", status="in_progress", expires_at=NOW + timedelta(days=1))
        session.add(batch)
        session.flush()
        batch_id = batch.id
    expire_once(settings, db_sessionmaker, store, now=NOW)
    with db_sessionmaker() as session:
        assert session.get(File, loose) is None and session.get(File, held) is not None
    assert not store.path(loose).exists() and store.path(held).exists()

    with db_sessionmaker.begin() as session:
        session.get(Batch, batch_id).status = "completed"
    expire_once(settings, db_sessionmaker, store, now=NOW)
    with db_sessionmaker() as session:
        assert session.get(File, held) is None
    assert not store.path(held).exists()
