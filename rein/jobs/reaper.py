"""The reaper: Postgres says what must run; the reaper makes Redis agree.

Redis holds the job messages, but a message can vanish: its worker was killed with the
message reserved or running, or Redis restarted without its data (no AOF, a failover,
FLUSHALL). The job row in Postgres outlives both, so one pass of the reaper, every
`Settings.reaper_interval_seconds`, puts things right:

1. **Expired leases.** A `running` job whose lease ran out (its worker stopped renewing it,
   see rein.jobs.claim) goes back to `queued` with a new message, its attempt refunded (the
   worker died, not the job). No death is counted against it: a worker that vanished whole
   took every job it held down at once, so it says nothing about which job, if any, was at
   fault (an engine that dies under a live worker does: rein.worker.suspects). One whose
   cancel was requested ends `cancelled`; one started MAX_STARTS times ends `failed`
   (`too_many_attempts`).
2. **Lost messages** (the outbox). A `queued` job that was sent (`sent_at`) over
   `Settings.requeue_unclaimed_seconds` ago, and whose message is not among those waiting on
   its queue, gets a new message. Which messages wait is read from the queue itself: its
   Redis lists are first in, first out, so the N messages on a model's list of a priority
   are the N jobs of that model and priority sent last; the queued jobs sent before those,
   and long enough ago, have lost theirs. The queue depth thus keeps its meaning for
   backpressure: a job is on the queue about once, never flooded with copies. When Redis
   comes back with a new run id (a restart: every message is gone), every queued job is
   sent again at once rather than after the bound.

Duplicates are harmless, whichever way they arise (the broker's own late redelivery of a
dead worker's messages, a message thought lost that was only slow): the claim's attempt
numbers let one attempt at most run and record a job.

One reaper pass runs at a time in a deployment: each pass holds a Postgres advisory
transaction lock, and a reaper that finds it taken skips the pass. Every worker and every
API process runs a reaper, so recovery does not depend on any one of them surviving.

After Postgres was unreachable, the reaper waits `lease_renew_seconds` and a margin before
it takes leases again: the workers could not renew theirs during the outage either, and
would otherwise lose jobs they are still running (and their finished results with them).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from celery import Celery
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.core.priorities import LAST_QUEUE_STEP
from rein.jobs.claim import MAX_STARTS, too_many_attempts_error
from rein.jobs.queues import enqueue_jobs, priority_lists
from rein.store.messages import JobMessage
from rein.store.tables import JOB_MESSAGE_COLUMNS

log = logging.getLogger(__name__)

# The advisory lock one reaper pass holds ("reap"; rein migrate uses "rein").
LOCK_ID = 0x72656170
# The most messages one pass sends again (the rest go in the next pass).
MAX_RESEND = 1000
# After Postgres came back, wait this long past a renewal interval before taking leases.
RENEW_MARGIN_SECONDS = 2.0
OUTAGE_LOG_SECONDS = 60.0


@dataclass(frozen=True)
class ReapReport:
    """What one pass did; `ran` is False when another reaper held the lock."""

    ran: bool = False
    requeued: int = 0        # expired leases, queued again
    cancelled: int = 0       # expired leases of jobs with a cancel requested
    gave_up: int = 0         # expired leases of jobs out of attempts
    resent: int = 0          # queued jobs whose message was lost

    @property
    def changed(self) -> bool:
        return any((self.requeued, self.cancelled, self.gave_up, self.resent))


# Expired leases, all three outcomes in one statement (an attempt that expired is over: the
# claim makes sure its worker can write nothing any more).
_REAP_SQL = f"""
UPDATE jobs SET
    status = CASE WHEN cancel_requested_at IS NOT NULL THEN 'cancelled'
                  WHEN attempt >= {MAX_STARTS} THEN 'failed' ELSE 'queued' END,
    finished_at = CASE WHEN cancel_requested_at IS NOT NULL OR attempt >= {MAX_STARTS} THEN now() END,
    error = CASE WHEN cancel_requested_at IS NULL AND attempt >= {MAX_STARTS}
                 THEN %(gave_up_error)s::jsonb END,
    attempts_refunded = attempts_refunded + 1,   -- as a claim would (rein.jobs.claim)
    sent_at = now(), worker = NULL, lease_expires_at = NULL, started_at = NULL, first_token_at = NULL
 WHERE id IN (SELECT id FROM jobs WHERE status = 'running' AND lease_expires_at < now()
               ORDER BY lease_expires_at LIMIT {MAX_RESEND} FOR UPDATE SKIP LOCKED)
RETURNING id, status, {", ".join(c.name for c in JOB_MESSAGE_COLUMNS if c.name != "id")}"""

_INT_MAX = 2**31 - 1   # jobs.priority is a Postgres integer

# Queued jobs sent before the bound, by model and priority step (each group's queue lists are
# read next; the priorities past the last step share its lists: rein.core.priorities.queue_step),
# the group waiting longest first: MAX_RESEND a pass is shared out oldest first.
_STALE_GROUPS_SQL = f"""
SELECT model, LEAST(GREATEST(priority, 0), {LAST_QUEUE_STEP}) AS step, count(*) FROM jobs
 WHERE status = 'queued' AND sent_at < now() - make_interval(secs => %s)
 GROUP BY model, step ORDER BY min(sent_at)"""

# Of one model's queued jobs of one priority step (priorities between the two bounds), newest
# sent first, those past the first `waiting` (the ones on the queue) and sent before the bound:
# their messages were lost.
_LOST_SQL = f"""
WITH ranked AS (
    SELECT id, sent_at, row_number() OVER (ORDER BY sent_at DESC, id DESC) AS newer
      FROM jobs WHERE status = 'queued' AND sent_at IS NOT NULL AND model = %s AND priority BETWEEN %s AND %s
), lost AS (
    SELECT id FROM ranked WHERE newer > %s AND sent_at < now() - make_interval(secs => %s)
     ORDER BY sent_at LIMIT %s
)
UPDATE jobs SET sent_at = now() FROM lost WHERE jobs.id = lost.id AND jobs.status = 'queued'
RETURNING {", ".join(f"jobs.{c.name}" for c in JOB_MESSAGE_COLUMNS)}"""


class Reaper:
    """A thread running `reap` every `settings.reaper_interval_seconds`."""

    def __init__(self, settings: Any, sessions: sessionmaker[Session], redis: Redis, celery: Celery,
                 name: str = "rein-reaper") -> None:
        self.settings = settings
        self.sessions = sessions
        self.redis = redis
        self.celery = celery
        self._redis_run_id: str | None = None
        self._db_up_since: float | None = None     # None: Postgres failed the last pass
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Reaper:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        failing_since: float | None = None
        while not self._stop.wait(self.settings.reaper_interval_seconds):
            try:
                self.reap()
            except (SQLAlchemyError, RedisError, OSError) as exc:
                # One line when an outage starts, then one a minute: not one per pass.
                now = time.monotonic()
                if failing_since is None or now - failing_since >= OUTAGE_LOG_SECONDS:
                    failing_since = now
                    log.warning("reaper pass failed (%s: %s); retrying every %g s", type(exc).__name__,
                                str(exc).strip().splitlines()[0] if str(exc).strip() else "",
                                self.settings.reaper_interval_seconds)
                continue
            except Exception:
                log.exception("reaper pass failed")
            if failing_since is not None:
                log.info("reaper: Postgres and Redis answer again")
                failing_since = None

    def reap(self, take_leases: bool | None = None) -> ReapReport:
        """One pass (see the module docstring). `take_leases` overrides the post-outage wait."""
        run_id = self.redis.info("server").get("run_id")
        # A new run id: Redis restarted, and its data may be gone. Remembered once a pass of
        # this reaper has run, so a pass that fails or finds the lock taken tries again.
        redis_restarted = self._redis_run_id is not None and run_id != self._redis_run_id
        now = time.monotonic()
        try:
            with self.sessions() as session, session.begin():
                if self._db_up_since is None:
                    self._db_up_since = now
                if not session.scalar(select(func.pg_try_advisory_xact_lock(LOCK_ID))):
                    if self._redis_run_id is None:
                        self._redis_run_id = run_id
                    return ReapReport()
                if take_leases is None:
                    take_leases = now - self._db_up_since >= self.settings.lease_renew_seconds + RENEW_MARGIN_SECONDS
                reaped = self._expired_leases(session) if take_leases else []
                lost = self._lost_messages(session, 0.0 if redis_restarted else
                                           self.settings.requeue_unclaimed_seconds)
                requeued = [row for row in reaped if row.status == "queued"]
                # Sent inside the transaction: if sending fails, nothing is marked sent or taken
                # back, and the next pass tries again.
                enqueue_jobs(self.celery, [JobMessage.for_job(row) for row in requeued + lost])
        except SQLAlchemyError:
            self._db_up_since = None
            raise
        self._redis_run_id = run_id
        report = ReapReport(ran=True, requeued=len(requeued), resent=len(lost),
                            cancelled=sum(row.status == "cancelled" for row in reaped),
                            gave_up=sum(row.status == "failed" for row in reaped))
        if report.changed:
            log.warning("reaper: %d expired leases queued again, %d cancelled, %d out of attempts; "
                        "%d lost messages sent again%s", report.requeued, report.cancelled, report.gave_up,
                        report.resent, " (Redis restarted)" if redis_restarted else "")
        return report

    def _expired_leases(self, session: Session) -> list[Any]:
        return session.connection().exec_driver_sql(_REAP_SQL, {
            "gave_up_error": json.dumps(too_many_attempts_error(MAX_STARTS))}).all()

    def _lost_messages(self, session: Session, bound_seconds: float) -> list[Any]:
        sql = session.connection().exec_driver_sql
        lost: list[Any] = []
        for model, step, _ in sql(_STALE_GROUPS_SQL, (bound_seconds,)).all():
            if len(lost) >= MAX_RESEND:
                break
            low = step if step > 0 else -_INT_MAX - 1
            high = step if step < LAST_QUEUE_STEP else _INT_MAX
            with self.redis.pipeline(transaction=False) as pipe:
                for key in priority_lists(self.settings, model, step):   # every batch shard's
                    pipe.llen(key)
                waiting = sum(pipe.execute())
            lost += sql(_LOST_SQL, (model, low, high, waiting, bound_seconds, MAX_RESEND - len(lost))).all()
        return lost

