"""The batch manager: a thread in each API process that moves batches through their statuses.

All of a batch's state lives in Postgres, so any API replica, or the same one after a
restart, carries on where another stopped. Each tick looks at every unfinished batch and,
holding a per-batch advisory transaction lock (`pg_try_advisory_xact_lock`: a batch another
replica is handling is skipped, not waited for), does the next step in one transaction:

* validating: read the input file and check every line (rein.batches.validation) with no
  transaction open: the batch's advisory lock is held at session level on a connection of
  its own (in autocommit), and each good line is spooled to a temporary file as it is
  checked. When all are good, one short transaction COPYs the spooled lines into the jobs
  table (unique on (batch_id, custom_id)) and moves the batch to `in_progress`: all the
  jobs exist or none do. A bad line: nothing is written and the batch is `failed`, with
  the bad lines listed. So a 50,000-line file holds no snapshot, row lock or `idle in
  transaction` connection for the minutes its check takes, and a cancel or a shutdown is
  noticed between lines. Lines are read under REIN_MAX_REQUEST_BYTES (a longer one is that
  line's error, skipped unread: rein.openai.batch_lines.read_lines), so a validation holds at
  most one line of that size and its parse. Each start of a validation is counted in
  `batches.validation_starts`, committed before the file is read, and taken back when it stops
  without a verdict (a shutdown, an outage): a count left behind is a process that died
  validating the batch (out of memory), and after MAX_VALIDATION_DEATHS of them the batch fails
  (`validation_crashed`) instead of killing every replica in turn until its deadline.
* in_progress: feed the model's queue. Batch jobs are not all sent at once: the manager
  keeps at most REIN_BATCH_QUEUE_WINDOW batch messages waiting on the model's queue (the
  batch priority lists), sending the next lines as workers drain it and stamping `sent_at`.
  A sent line whose message was lost (Redis restarted without its data, a dead worker's
  reserved messages) is sent again by the reaper (rein.jobs.reaper), as any job is.
  So 50,000 lines never fill the queue that backpressure measures, interactive jobs
  (priority 0) are always taken first, and a cancel has few messages to skip. Lines go in
  prefix order (REIN_BATCH_ORDER, default `prefix`: by the prompt's first tokens, the jobs'
  `feed_key`), so the lines sharing a system prompt reach the workers together and run while
  it is in their prefix cache, or in the file's order (`file`). Each line waits on the batch
  queue shard of its prefix (REIN_BATCH_AFFINITY, rein.jobs.affinity: the lines about one
  document on one shard, which one worker takes first), chosen across the whole file while it
  is checked; the window is split between the shards the batch has lines left on. A tenant
  whose batch lines sent and not finished hold REIN_MAX_QUEUED_BATCH_TOKENS_PER_TENANT tokens
  (prompt + n x max_tokens each) is sent no more until some finish; its lines wait, and the
  other tenants' batches share the room. A message is sent before its `sent_at` commits: after a crash in between it is sent again, which
  the worker's claim lease makes harmless (the second delivery finds the job taken or
  finished). When no job is queued or running: `finalizing`.
* Expiry: past `expires_at`, the queued jobs are cancelled and the running ones aborted
  (as a job cancel does: a flag plus a message every worker hears, see rein.worker.cancel);
  `expired_at` is set and the batch goes `finalizing`, then `expired`. Finished requests
  stay in the output and in usage; the others become `batch_expired` error lines.
* cancelling (set by POST /v1/batches/{id}/cancel): the same drop as expiry; once nothing
  runs, `cancelled`, with completed results kept.
* finalizing: once nothing runs, write the output and error files (rein.batches.result_files)
  and set the final status, in one transaction.
* Webhooks: the transaction that sets a final status (completed, failed, cancelled, expired)
  also writes the batch's event to the outbox (rein.batches.webhooks.events), when its tenant
  has an endpoint for it.

Isolation: validations run on threads of their own (REIN_BATCH_VALIDATOR_THREADS), so a large
file never stalls the other batches' steps, and one tenant's batches take at most half of them
(at least one), so another tenant's batch validates beside a tenant's 50,000-line file. An
unexpected error while validating fails that batch alone (code `validation_error`, naming the
line), and a batch still validating REIN_BATCH_VALIDATION_TIMEOUT_SECONDS after its creation
fails (`validation_timeout`), checked before every line (the status, for a cancel, every
STATUS_CHECK_SECONDS).
Feeding is fair: each tick splits a model's queue room evenly between the tenants with
running batches, then between each tenant's batches, and visits batches round-robin across
tenants, so one tenant's 50,000-line batches cannot starve another tenant's.

A running job whose abort is never confirmed (its worker died) is marked cancelled after
ABORT_GRACE_SECONDS; the worker's recorder only writes under a live `running` lease, so
nothing is recorded or billed twice. The manager polls every REIN_BATCH_POLL_SECONDS and
is woken at once when this process creates or cancels a batch, and when a worker has recorded
batch lines (rein.batches.wakeup), at most every BATCH_WAKE_MIN_SECONDS.

Beside it: the per-batch lock (rein.batches.locks), the batch's job rows (rein.batches.batch_jobs)
and the fairness rules (rein.batches.fairness).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from celery import Celery
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.batches.batch_jobs import (
    OPEN_JOB_STATUSES,
    copy_jobs,
    drop_batch_jobs,
    open_jobs,
    queued_batch_tokens,
    spool_job,
    spooled_jobs,
)
from rein.batches.fairness import feeding_shares, lines_within_tokens, round_robin
from rein.batches.locks import hold_batch_lock, try_lock_batch
from rein.batches.result_files import write_result_files
from rein.batches.validation import FailedLine, ValidLine, validate_lines
from rein.batches.wakeup import BATCH_WAKE_MIN_SECONDS, BatchEventListener
from rein.batches.webhooks.events import record_batch_event
from rein.core.priorities import LAST_QUEUE_STEP, PRIORITY_BATCH
from rein.core.settings import Settings
from rein.engine.structured.validator import ValidatorUnavailable
from rein.jobs.affinity import BATCH_SHARDS, PrefixGroups
from rein.jobs.image_sources import ImageSources, store_images
from rein.jobs.queues import enqueue_jobs, priority_lists
from rein.jobs.registry import ModelRegistry
from rein.openai.batch_lines import read_lines
from rein.store.filestore import FileStore
from rein.store.messages import JobMessage
from rein.store.redis_keys import RedisKeys
from rein.store.tables import JOB_MESSAGE_COLUMNS, Batch, File, Job

log = logging.getLogger(__name__)

ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
ABORT_GRACE_SECONDS = 60
# The spooled row's key holding a failed line's error (rein.batches.validation.FailedLine).
FAILED_LINE_ERROR = "_failed_line_error"
STATUS_CHECK_SECONDS = 2.0     # how often a validation looks whether its batch was cancelled
# Validations of one batch whose process died (out of memory, most likely) before the next start
# fails the batch instead: a retry for a death that was not the file's doing, not a crash loop.
MAX_VALIDATION_DEATHS = 2


@dataclass
class Share:
    """A batch's part of one tick's feeding: how many lines it may send, and the messages
    waiting on each batch queue shard of its model (shared by the model's batches in a tick)."""

    lines: int
    waiting: list[int]


class _Superseded(Exception):
    """The batch changed status under a step; roll the step back."""


class _ValidationFailed(Exception):
    """Some line is bad (or the file is gone, or the deadline passed): record the errors."""

    def __init__(self, batch_id: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(batch_id)
        self.batch_id = batch_id
        self.errors = errors


class BatchManager:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session], redis: Redis, celery: Celery,
                 registry: ModelRegistry, store: FileStore) -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis
        self.celery = celery
        self.registry = registry
        self.store = store
        # Image lines' images: loaded while a line is checked, kept in the file store (rein.jobs.image_sources).
        self.images = ImageSources(settings, store, sessions)
        self.keys = RedisKeys.from_settings(settings)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rein-batch-manager", daemon=True)
        # Workers' "batch lines recorded" (rein.batches.wakeup): a tick at once, not at the next poll.
        self._events = BatchEventListener(redis, self.keys, self.wake)
        threads = settings.batch_validator_threads
        self._validator = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rein-batch-validator")
        self._tenant_share = max(1, threads // 2)   # validations one tenant may have in flight
        self._validating: dict[str, str] = {}        # batch id -> tenant, submitted and not done
        self._validating_lock = threading.Lock()
        # Batch id -> the batch queue shards it has no unsent line on (a line once sent is
        # never unsent again), so the window goes to the shards that can use it.
        self._drained: dict[str, set[int]] = {}

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> BatchManager:
        self._events.start()
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        self._events.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._validator.shutdown(wait=True, cancel_futures=True)

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            try:
                self.tick()
            except Exception:   # Postgres or Redis away: log, and try again next tick
                log.exception("batch manager tick failed")
            if self._wake.wait(self.settings.batch_poll_seconds):
                # Woken (batch events come as fast as workers record lines): a few ticks a second at most.
                self._stop.wait(BATCH_WAKE_MIN_SECONDS - (time.monotonic() - started))

    def tick(self) -> None:
        """One pass over every unfinished batch.

        Validations run on their own threads (`_validator`), each tenant's share at a time, so a
        large or slow file never holds up feeding and finishing the others. Batch lines are fed to
        each model's queue in shares: the room on the queue is split evenly between the
        tenants with running batches, then between each tenant's batches (`feeding_shares`),
        then each batch's share between the batch queue shards it has lines on
        (`_next_lines`, rein.jobs.affinity), and the batches are visited round-robin across
        tenants.
        """
        with self.sessions() as session:
            rows = session.execute(select(Batch.id, Batch.status, Batch.tenant, Batch.model)
                                   .where(Batch.status.in_(ACTIVE_STATUSES))
                                   .order_by(Batch.created_at, Batch.id)).all()
        shares = self._feeding_shares([row for row in rows if row.status == "in_progress"])
        for row in round_robin(rows):
            if self._stop.is_set():
                return
            if row.status == "validating":
                self._validate_in_background(row.id, row.tenant)
                continue
            try:
                self.advance(row.id, shares)
            except Exception:
                log.exception("batch %s: step failed; retrying next tick", row.id)

    def _feeding_shares(self, running: list[Any]) -> dict[str, Share]:
        """Batch id -> how many more of its lines may be sent this tick, with the messages
        waiting on each of its model's batch shards (updated as lines are sent). A tenant at its
        cap on queued batch tokens gets no share, so the others share all the room."""
        self._drained = {batch_id: shards for batch_id, shards in self._drained.items()
                         if batch_id in {row.id for row in running}}
        cap = self.settings.max_queued_batch_tokens_per_tenant
        if cap and running:
            with self.sessions() as session:
                queued = queued_batch_tokens(session, {row.tenant for row in running})
            running = [row for row in running if queued.get(row.tenant, 0) < cap]
        by_model: dict[str, list[Any]] = {}
        for row in running:
            by_model.setdefault(row.model or "", []).append(row)
        shares: dict[str, Share] = {}
        for model, batches in by_model.items():
            waiting = self._waiting_by_shard(model)
            room = max(self.settings.batch_queue_window - sum(waiting), 0)
            for batch_id, share in feeding_shares(room, [(row.tenant, row.id) for row in batches]).items():
                shares[batch_id] = Share(share, waiting)
        return shares

    def _waiting_by_shard(self, model: str) -> list[int]:
        """The batch messages waiting on each of the model's batch queue shards (at every batch
        priority step: lines with a `priority` wait at later steps, rein.core.priorities)."""
        steps = range(PRIORITY_BATCH, LAST_QUEUE_STEP + 1)
        pipe = self.redis.pipeline(transaction=False)
        for step in steps:
            for key in priority_lists(self.settings, model, step):   # one list per shard, in shard order
                pipe.llen(key)
        lengths = pipe.execute()
        shards = len(lengths) // len(steps)
        return [sum(lengths[shard::shards]) for shard in range(shards)]

    def _validate_in_background(self, batch_id: str, tenant: str) -> None:
        """Validate on a validator thread, unless the batch is already there or its tenant holds
        its share of them (then a later tick tries again)."""
        with self._validating_lock:
            if batch_id in self._validating:
                return
            if sum(t == tenant for t in self._validating.values()) >= self._tenant_share:
                return
            self._validating[batch_id] = tenant

        def run() -> None:
            try:
                self.advance(batch_id)
            except Exception:
                log.exception("batch %s: validation step failed; retrying next tick", batch_id)
            finally:
                with self._validating_lock:
                    self._validating.pop(batch_id, None)
                self.wake()

        self._validator.submit(run)

    def advance(self, batch_id: str, shares: dict[str, Share] | None = None) -> None:
        """Do the batch's next step, unless another manager holds it right now.

        `shares`: how many lines each batch may send now (see `tick`); without it, a batch
        may fill whatever room its model's queue has.
        """
        try:
            self._advance(batch_id, shares)
        except _Superseded:
            pass

    def _advance(self, batch_id: str, shares: dict[str, Share] | None) -> None:
        with self.sessions() as session, session.begin():
            if not try_lock_batch(session, batch_id):
                return
            batch = session.scalars(select(Batch).where(Batch.id == batch_id)
                                    .execution_options(populate_existing=True)).one()
            status = batch.status
            if status == "in_progress":
                self._progress(session, batch, shares)
            elif status in ("finalizing", "cancelling"):
                self._finish(session, batch)
        if status == "validating":      # long: outside any transaction (the module docstring)
            self._validate(batch_id)

    # -- steps ------------------------------------------------------------------------------

    def _validate(self, batch_id: str) -> None:
        with hold_batch_lock(self.sessions, batch_id) as lock:
            if lock is None:             # another manager is validating it
                return
            deaths = self._start_validation(batch_id)
            if deaths is None:           # no longer validating
                return
            try:
                if deaths >= MAX_VALIDATION_DEATHS:
                    raise _ValidationFailed(batch_id, [_crashed_error(deaths, self.settings.max_request_bytes)])
                self._validate_locked(lock, batch_id)
            except _ValidationFailed as failed:
                with self.sessions() as session, session.begin():
                    self._fail(session, failed.batch_id, failed.errors)
            except Exception:
                # Stopped without a verdict, by a shutdown, an outage or a bug, in a process alive to
                # say so: not a death, so this start is taken back (a retry comes next tick).
                self._forget_start(batch_id)
                raise

    def _start_validation(self, batch_id: str) -> int | None:
        """Count this start of the batch's validation, committed before its file is read, so a
        process that dies reading it (out of memory) leaves the count behind for the next one to
        see. The starts before this one that never ended, each a process that died validating
        the batch; None when the batch is no longer validating."""
        with self.sessions() as session, session.begin():
            starts = session.scalar(
                update(Batch).where(Batch.id == batch_id, Batch.status == "validating")
                .values(validation_starts=Batch.validation_starts + 1).returning(Batch.validation_starts))
        return None if starts is None else starts - 1

    def _forget_start(self, batch_id: str) -> None:
        """Take back the start `_start_validation` counted (best effort: when Postgres is away too,
        the start counts as a death)."""
        try:
            with self.sessions() as session, session.begin():
                session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating",
                                                    Batch.validation_starts > 0)
                                .values(validation_starts=Batch.validation_starts - 1))
        except SQLAlchemyError as exc:
            log.warning("batch %s: its validation start was not taken back (%s)", batch_id, exc)

    def _validate_locked(self, lock: Connection, batch_id: str) -> None:
        with self.sessions() as session:
            batch = session.get(Batch, batch_id)
            if batch is None or batch.status != "validating":
                return
            file = session.scalars(select(File).where(File.id == batch.input_file_id,
                                                      File.tenant == batch.tenant)).one_or_none()
            past_deadline = session.scalar(select(func.now() > batch.created_at + timedelta(
                seconds=self.settings.batch_validation_timeout_seconds)))
        # (closing the session ended its transaction: nothing stays open while the lines are checked)
        try:
            source = self.store.open(batch.input_file_id) if file is not None else None
        except FileNotFoundError:
            source = None
        if source is None:
            raise _ValidationFailed(batch.id, [{
                "code": "file_not_found", "line": None, "param": "input_file_id",
                "message": f"the input file {batch.input_file_id} was deleted before the batch was validated"}])
        deadline_seconds = self.settings.batch_validation_timeout_seconds
        if past_deadline:
            source.close()
            raise _ValidationFailed(batch.id, [_timeout_error(deadline_seconds)])
        started = time.monotonic()
        status_checked = started
        fixed = {"tenant": batch.tenant, "key_id": batch.key_id, "batch_id": batch.id}
        last_line = 0

        def check(number: int) -> None:   # before every line, valid or not
            nonlocal status_checked
            if self._stop.is_set():      # shutting down: nothing was written, the next manager starts over
                raise _Superseded(batch.id)
            now = time.monotonic()
            if now - started > deadline_seconds:
                raise _ValidationFailed(batch.id, [_timeout_error(deadline_seconds)])
            if now - status_checked > STATUS_CHECK_SECONDS:
                status_checked = now
                if lock.scalar(select(Batch.status).where(Batch.id == batch.id)) != "validating":
                    raise _Superseded(batch.id)     # cancelled meanwhile

        # Lines sharing a document get one batch queue shard (rein.jobs.affinity), found across
        # the whole file: counted while it is checked, assigned when it is stored.
        groups = PrefixGroups() if self.settings.batch_affinity else None

        def store(line: ValidLine) -> None:
            nonlocal last_line
            if line.prepared.images:    # before its job exists; content-addressed, so a retry rewrites nothing
                store_images(self.store, line.prepared.images, self.sessions)
            values = line.job_values() | fixed
            spool_job(spool, values)
            if groups is not None:
                groups.add(values["prompt_token_ids"])
            last_line = line.line

        def store_failed(line: FailedLine) -> None:
            # Its job row, marked failed with its error once stored (below): it fails alone.
            nonlocal last_line
            spool_job(spool, line.job_values() | fixed | {FAILED_LINE_ERROR: line.error})
            last_line = line.line

        with tempfile.TemporaryFile(prefix="rein-batch-") as spool:
            try:
                with source:
                    lines = read_lines(source, self.settings.max_request_bytes)   # each under the cap
                    result = validate_lines(lines, batch.endpoint, self.registry,
                                            self.settings.batch_max_requests, on_valid=store, before_line=check,
                                            max_embedding_inputs=self.settings.batch_max_embedding_inputs,
                                            images=self.images.for_request(batch.tenant), on_failed=store_failed)
            except (_Superseded, _ValidationFailed, OperationalError, InterfaceError, RedisError,
                    ValidatorUnavailable):
                raise                    # a stop, a verdict, or an outage (retried next tick)
            except Exception as exc:
                # Anything else is this file's doing, not the service's: fail this batch alone,
                # rather than retry it every tick for ever.
                log.exception("batch %s: validation broke near line %d", batch.id, last_line + 1)
                raise _ValidationFailed(batch.id, [{
                    "code": "validation_error", "line": last_line + 1, "param": None,
                    "message": f"validating line {last_line + 1} failed unexpectedly ({type(exc).__name__}); "
                               f"lines 1 to {last_line} were fine. Check that line, or split the file to "
                               f"find the request that causes it."}]) from exc
            if not result.ok:
                raise _ValidationFailed(batch.id, result.errors)
            checked = time.monotonic() - started
            spool.seek(0)
            failed: list[tuple[int, dict[str, Any]]] = []
            with self.sessions() as session, session.begin():
                with copy_jobs(session, groups.shard if groups is not None else None) as write_job:
                    for row in spooled_jobs(spool):
                        write_job(row)
                        if FAILED_LINE_ERROR in row:
                            failed.append((row["batch_line"], row[FAILED_LINE_ERROR]))
                for line_number, error in failed:   # never sent: the feed takes queued lines only
                    session.execute(update(Job).where(Job.batch_id == batch.id, Job.batch_line == line_number)
                                    .values(status="failed", error=error, finished_at=func.now()))
                moved = session.execute(
                    update(Batch).where(Batch.id == batch.id, Batch.status == "validating")
                    .values(status="in_progress", in_progress_at=func.now(), model=result.model,
                            request_total=result.valid + result.failed_lines).returning(Batch.id)).one_or_none()
                if moved is None:        # cancelled meanwhile: the jobs go with the rolled-back transaction
                    raise _Superseded(batch.id)
        log.info("batch %s: %d requests validated in %.1f s and stored in %.1f s", batch.id, result.valid,
                 checked, time.monotonic() - started - checked)
        self.wake()          # feed it at once rather than next tick

    def _fail(self, session: Session, batch_id: str, errors: list[dict[str, Any]]) -> None:
        failed = session.execute(update(Batch).where(Batch.id == batch_id, Batch.status == "validating")
                                 .values(status="failed", failed_at=func.now(),
                                         errors={"object": "list", "data": errors}).returning(Batch.id)).first()
        if failed is not None:    # webhooks: the event commits with the status (rein.batches.webhooks)
            record_batch_event(session, batch_id, "failed")
        log.info("batch %s failed validation: %d errors", batch_id, len(errors))

    def _progress(self, session: Session, batch: Batch, shares: dict[str, Share] | None) -> None:
        expired = session.scalar(select(func.now() >= batch.expires_at))
        if expired:
            drop_batch_jobs(session, self.redis, self.keys, self.settings, batch.id)
            session.execute(update(Batch).where(Batch.id == batch.id)
                            .values(status="finalizing", expired_at=func.now(), finalizing_at=func.now()))
            log.info("batch %s expired: unfinished requests dropped", batch.id)
            return
        if not open_jobs(session, batch.id):
            session.execute(update(Batch).where(Batch.id == batch.id)
                            .values(status="finalizing", finalizing_at=func.now()))
            session.flush()
            session.refresh(batch)
            self._finish(session, batch)
            return
        self._feed(session, batch, shares)

    def _feed(self, session: Session, batch: Batch, shares: dict[str, Share] | None) -> None:
        if shares is None:
            waiting = self._waiting_by_shard(batch.model or "")
            share = Share(max(self.settings.batch_queue_window - sum(waiting), 0), waiting)
        else:
            share = shares.get(batch.id, Share(0, []))
        if share.lines <= 0:
            return
        cap = self.settings.max_queued_batch_tokens_per_tenant
        token_room = None
        if cap:   # (again here: the tenant's other batches fed earlier in this tick count too)
            token_room = cap - queued_batch_tokens(session, [batch.tenant]).get(batch.tenant, 0)
            if token_room <= 0:
                return           # its lines wait until the tenant's queued ones finish
        rows = self._next_lines(session, batch.id, share, token_room)
        # The whole chunk in one pipeline.
        enqueue_jobs(self.celery, [JobMessage.for_job(row) for row in rows])
        if rows:
            session.execute(update(Job).where(Job.id.in_([row.id for row in rows])).values(sent_at=func.now()))

    def _next_lines(self, session: Session, batch_id: str, share: Share, token_room: int | None) -> list[Any]:
        """Up to `share.lines` of the batch's unsent lines, each shard's in the batch order, the
        model's queue window split evenly between the shards the batch still has lines on (a
        shard found short is left out and its part goes to the others, in this same call), and
        while its tenant has `token_room` (None: no cap) under the queued batch token cap."""
        # A line's own priority first (rein.core.priorities): the batch sends its better lines first.
        order = (Job.priority, Job.batch_line) if self.settings.batch_order == "file" \
            else (Job.priority, Job.feed_key, Job.batch_line)
        drained = self._drained.setdefault(batch_id, set())
        shards = [shard for shard in (range(BATCH_SHARDS) if self.settings.batch_affinity else [0])
                  if shard not in drained]
        rows: list[Any] = []
        taken = dict.fromkeys(shards, 0)      # each shard's lines found so far (not yet marked sent)
        left = share.lines
        while left > 0 and shards:
            even = -(-self.settings.batch_queue_window // len(shards))
            for shard in shards:
                count = min(max(even - share.waiting[shard], 0), left)
                if count <= 0:
                    continue
                found = session.execute(
                    select(*JOB_MESSAGE_COLUMNS, func.coalesce(Job.requested_tokens, Job.prompt_tokens).label("tokens"))
                    .where(Job.batch_id == batch_id, Job.shard == shard, Job.status == "queued",
                           Job.sent_at.is_(None))
                    .order_by(*order).offset(taken[shard]).limit(count)).all()
                within = lines_within_tokens([row.tokens for row in found], token_room)
                rows += found[:within]
                if within < len(found):
                    return rows          # the tenant's token room is used up
                if token_room is not None:
                    token_room -= sum(row.tokens for row in found)
                taken[shard] += len(found)
                share.waiting[shard] += len(found)
                left -= len(found)
                if len(found) < count:
                    drained.add(shard)
            if not drained.intersection(shards):
                break                    # every shard took its part: the window is full
            shards = [shard for shard in shards if shard not in drained]
        return rows

    def _finish(self, session: Session, batch: Batch) -> None:
        """finalizing or cancelling: once no job is open, write the files and end the batch."""
        dropping = batch.status == "cancelling" or batch.expired_at is not None
        if dropping:
            drop_batch_jobs(session, self.redis, self.keys, self.settings, batch.id)
        if open_jobs(session, batch.id):
            since = batch.cancelling_at or batch.expired_at
            if dropping and since is not None and session.scalar(
                    select(func.now() > since + timedelta(seconds=ABORT_GRACE_SECONDS))):
                # Aborts never confirmed (their worker is gone): end them here; a late
                # recorder finds no running lease and writes nothing.
                session.execute(update(Job).where(Job.batch_id == batch.id, Job.status.in_(OPEN_JOB_STATUSES))
                                .values(status="cancelled", finished_at=func.now(), lease_expires_at=None))
            return
        output_id, error_id = write_result_files(session, self.store, batch)
        if batch.status == "cancelling":
            final = {"status": "cancelled", "cancelled_at": func.now()}
        elif batch.expired_at is not None:
            final = {"status": "expired"}
        else:
            final = {"status": "completed", "completed_at": func.now()}
        ended = session.execute(update(Batch).where(Batch.id == batch.id, Batch.status == batch.status)
                                .values(output_file_id=output_id, error_file_id=error_id, **final)
                                .returning(Batch.id)).first()
        if ended is not None:     # webhooks: the event commits with the status (rein.batches.webhooks)
            record_batch_event(session, batch.id, final["status"])
        log.info("batch %s %s", batch.id, final["status"])


def _crashed_error(deaths: int, max_line_bytes: int) -> dict[str, Any]:
    return {"code": "validation_crashed", "line": None, "param": None,
            "message": f"validation of this batch was started {deaths} times and its process died each time "
                       f"(out of memory, most likely), so it is not tried again. Split the input file into "
                       f"smaller batches, or make its largest requests smaller: checking a line takes about 25 "
                       f"times its bytes in memory (lines over REIN_MAX_REQUEST_BYTES, {max_line_bytes} bytes, "
                       f"are refused unread)"}


def _timeout_error(seconds: float) -> dict[str, Any]:
    return {"code": "validation_timeout", "line": None, "param": None,
            "message": f"the batch was not validated within {seconds:g} s (REIN_BATCH_VALIDATION_TIMEOUT_SECONDS); "
                       f"split the input file into smaller batches"}
