"""Retention: what a tenant's work leaves behind expires, and what it keeps counts toward its
storage quota.

Four things expire, each after its own setting (days; 0 or unset: kept for good):

* job results (`results` rows: the text, token ids, logprobs and response parts a job
  produced, which is also what a job's event stream replays from Postgres), after
  REIN_RESULT_RETENTION_DAYS (30, as OpenAI keeps batch outputs): the job row stays, with
  its status, timings and usage, and answers without a `response` from then on;
* files (uploads and batch output and error files: the row and the bytes in the file store)
  once their `expires_at` has passed (rein.batches.expiry: OpenAI's `expires_after` and
  `output_expires_after`, else REIN_BATCH_FILE_EXPIRY_SECONDS, 30 days); a batch still names
  them, and they answer 404 like a deleted file. The input file of a batch that has not
  ended is kept until the batch ends (the first sweep after deletes it): the batch manager
  reads it while validating, and a batch's input file is the record of what it ran;
* stored images (the file store's `image-<sha256>`, rein.jobs.image_sources), once no request
  has named one for REIN_IMAGE_RETENTION_SECONDS (7 days) and no queued or running job names it;
* usage rows, after REIN_USAGE_RETENTION_DAYS (400: usage is accounting, kept over a year
  so a year's invoices can be checked against it).

`expire_once` deletes in bounded batches (REIN_RETENTION_BATCH rows a transaction, each
taken FOR UPDATE SKIP LOCKED), so it never holds long locks or a long transaction, and any
number of API replicas may run it at once: each takes rows the others have not, and a row
already gone is simply not found (idempotent). A file's bytes are deleted inside the
transaction that deletes its row, before the commit: if the commit fails the row stays and
the next pass deletes the (already absent) bytes again, so no row outlives its bytes
unnoticed and no bytes are left without a row. `RetentionLoop` runs it every
REIN_RETENTION_INTERVAL_SECONDS in each API process (where the file store is).

`stored_bytes` is what the storage quota counts (rein.api.routes.files): uploads, output and
error files, and the tenant's job results as Postgres stores them.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.jobs.image_sources import image_file_id
from rein.store.filestore import FileStore
from rein.store.tables import Batch, File, Job, Result, StoredImage, Usage

log = logging.getLogger(__name__)

OUTPUT_PURPOSE = "batch_output"
# A batch in these statuses may still read its input file, which the sweep then keeps.
UNFINISHED_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
# A pass stops after this many batches of one kind, so one pass never runs for long; the
# next pass goes on where it stopped.
MAX_BATCHES_PER_PASS = 100


@dataclass(frozen=True)
class StoredBytes:
    """A tenant's storage, as its quota counts it."""

    uploads: int
    outputs: int
    results: int

    @property
    def total(self) -> int:
        return self.uploads + self.outputs + self.results


def stored_bytes(session: Session, tenant: str) -> StoredBytes:
    """The tenant's stored bytes: uploaded files, batch output and error files, and its job
    results as Postgres stores them (each row's size on disk, pg_column_size)."""
    uploads, outputs = session.execute(
        select(func.coalesce(func.sum(File.bytes).filter(File.purpose != OUTPUT_PURPOSE), 0),
               func.coalesce(func.sum(File.bytes).filter(File.purpose == OUTPUT_PURPOSE), 0))
        .where(File.tenant == tenant)).one()
    results = session.scalar(
        select(func.coalesce(func.sum(func.pg_column_size(text("results.*"))), 0))
        .select_from(Result).join(Job, Job.id == Result.job_id).where(Job.tenant == tenant)) or 0
    return StoredBytes(uploads=int(uploads), outputs=int(outputs), results=int(results))


@dataclass(frozen=True)
class RetentionReport:
    results: int = 0
    files: int = 0
    usage: int = 0
    images: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.results or self.files or self.usage or self.images)


def _cutoff(days: float | None, now: datetime) -> datetime | None:
    return None if not days else now - timedelta(days=days)


def expire_once(settings: Any, sessions: sessionmaker[Session], store: FileStore,
                now: datetime | None = None) -> RetentionReport:
    """Delete what is past its retention (see the module docstring); what was deleted."""
    now = datetime.now(UTC) if now is None else now
    batch = settings.retention_batch
    results = files = usage = 0
    cutoff = _cutoff(settings.result_retention_days, now)
    if cutoff is not None:
        results = _in_batches(sessions, batch, lambda session: _delete_results(session, cutoff, batch))
    files = _in_batches(sessions, batch, lambda session: _delete_expired_files(session, store, now, batch))
    cutoff = _cutoff(settings.usage_retention_days, now)
    if cutoff is not None:
        usage = _in_batches(sessions, batch, lambda session: _delete_usage(session, cutoff, batch))
    images = 0
    seconds = getattr(settings, "image_retention_seconds", None)
    if seconds:
        image_cutoff = now - timedelta(seconds=seconds)
        images = _in_batches(sessions, batch, lambda session: _delete_unused_images(session, store, image_cutoff,
                                                                                     batch))
    return RetentionReport(results=results, files=files, usage=usage, images=images)


def _in_batches(sessions: sessionmaker[Session], batch: int, step: Any) -> int:
    """Run `step` (one batch, in its own transaction) until it deletes less than a batch."""
    deleted = 0
    for _ in range(MAX_BATCHES_PER_PASS):
        with sessions.begin() as session:
            count = step(session)
        deleted += count
        if count < batch:
            break
    return deleted


def _delete_results(session: Session, cutoff: datetime, batch: int) -> int:
    chosen = (select(Result.job_id).where(Result.created_at < cutoff).limit(batch)
              .with_for_update(skip_locked=True))
    return len(session.execute(delete(Result).where(Result.job_id.in_(chosen.scalar_subquery()))
                               .returning(Result.job_id)).all())


def _delete_usage(session: Session, cutoff: datetime, batch: int) -> int:
    chosen = select(Usage.id).where(Usage.created_at < cutoff).limit(batch).with_for_update(skip_locked=True)
    return len(session.execute(delete(Usage).where(Usage.id.in_(chosen.scalar_subquery()))
                               .returning(Usage.id)).all())


def _delete_expired_files(session: Session, store: FileStore, now: datetime, batch: int) -> int:
    read_by_a_batch = (select(Batch.id).where(Batch.input_file_id == File.id, Batch.tenant == File.tenant,
                                              Batch.status.in_(UNFINISHED_BATCH_STATUSES)).exists())
    ids = list(session.scalars(
        select(File.id).where(File.expires_at <= now, ~read_by_a_batch).limit(batch)
        .with_for_update(of=File, skip_locked=True)))
    for file_id in ids:
        store.delete(file_id)       # before the commit: a failed commit leaves the row to retry
    if ids:
        session.execute(delete(File).where(File.id.in_(ids)))
    return len(ids)


# Stored images no request named since the cutoff and no open job names (their jobs have run:
# a worker reads a job's images only while running it). One scan of the open jobs' image lists.
_UNUSED_IMAGES = text("""
SELECT sha256 FROM stored_images
 WHERE last_used_at < :cutoff
   AND sha256 NOT IN (SELECT image->>'sha256' FROM jobs, jsonb_array_elements(jobs.params->'images') AS image
                       WHERE jobs.status IN ('queued', 'running') AND jsonb_typeof(jobs.params->'images') = 'array')
 ORDER BY last_used_at LIMIT :batch FOR UPDATE OF stored_images SKIP LOCKED""")


def _delete_unused_images(session: Session, store: FileStore, cutoff: datetime, batch: int) -> int:
    """Delete a batch of unused stored images (rein.jobs.image_sources): the bytes before the
    commit, as files' (a request naming one meanwhile waits on its row lock, then stores it anew)."""
    ids = list(session.scalars(_UNUSED_IMAGES, {"cutoff": cutoff, "batch": batch}))
    for sha256 in ids:
        store.delete(image_file_id(sha256))
    if ids:
        session.execute(delete(StoredImage).where(StoredImage.sha256.in_(ids)))
    return len(ids)


class RetentionLoop:
    """A thread running `expire_once` every `settings.retention_interval_seconds`."""

    def __init__(self, settings: Any, sessions: sessionmaker[Session], store: FileStore,
                 name: str = "rein-retention") -> None:
        self.settings = settings
        self.sessions = sessions
        self.store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> RetentionLoop:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.retention_interval_seconds):
            try:
                report = expire_once(self.settings, self.sessions, self.store)
            except (SQLAlchemyError, OSError) as exc:
                log.warning("retention pass failed (%s); next in %g s", type(exc).__name__,
                            self.settings.retention_interval_seconds)
                continue
            except Exception:
                log.exception("retention pass failed")
                continue
            if report.changed:
                log.info("retention: %d job results, %d files, %d usage rows and %d stored images expired",
                         report.results, report.files, report.usage, report.images)
