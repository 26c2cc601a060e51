"""How a task ends a claimed job's attempt: fail it, record it (waiting out a Postgres outage),
settle its token charge, or hand it back to the queue; and the look for a cancel that came
between the claim and the submit.

Shared by the generation task (rein.worker.tasks) and the embeddings one
(rein.worker.embeddings), which end their attempts the same ways.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError
from sqlalchemy.exc import InterfaceError, OperationalError

from rein.jobs.cancel import is_cancel_requested
from rein.jobs.claim import Lease, release_job
from rein.jobs.queues import enqueue_job
from rein.jobs.ratelimit import settle_tokens
from rein.store.messages import JobMessage
from rein.worker.recorder import JobRecord, record_job

if TYPE_CHECKING:
    from rein.worker.context import WorkerContext
    from rein.worker.suspects import Suspicion

log = logging.getLogger(__name__)

# After aborting a job that ran out of time, how long to wait for the engine to confirm.
ABORT_GRACE_SECONDS = 30.0
# How long a finished job's result waits for Postgres to come back before it is given up (the
# job then runs again once its lease expires), and the longest pause between two tries.
RECORD_RETRY_SECONDS = 600.0
RECORD_RETRY_MAX_DELAY = 2.0
# The longest a task waits for its job's last token events to be sent before recording it.
PUBLISH_FLUSH_SECONDS = 5.0


def abort_if_cancelled(context: WorkerContext, job_id: str, cancel_mark: int | None = None) -> None:
    """Abort a just-submitted job whose cancel came between the claim and the submit.

    `cancel_mark`: the cancel listener's mark from before the claim. While the listener has
    stayed subscribed since then, what it heard is the answer (no round trip); otherwise the
    job's cancel flag in Redis is (rein.worker.cancel)."""
    listener = context.listener
    heard = listener.heard_since(job_id, cancel_mark) if listener is not None else None
    if heard is not None:
        if heard:
            context.runner.abort(job_id)
        return
    try:
        if is_cancel_requested(context.redis, context.keys, job_id):
            context.runner.abort(job_id)
    except RedisError:   # the cancel listener checks the flags of its jobs when Redis is back
        pass


def error_body(message: str, type_: str, code: str | None) -> dict[str, Any]:
    return {"message": message, "type": type_, "code": code}


def fail_job(context: WorkerContext, lease: Lease, message: str, type_: str, code: str | None) -> str:
    log.warning("job %s failed: %s", lease.job_id, message)
    context.publisher.publish_final(lease.job_id, error=message)
    record_result(context, lease, JobRecord(status="failed", error=error_body(message, type_, code)))
    return "failed"


def record_result(context: WorkerContext, lease: Lease, record: JobRecord, *, charged: bool = True) -> bool:
    """`record_job`, waiting out a Postgres outage (up to RECORD_RETRY_SECONDS): a computed
    result is kept until it is stored. The job stays tracked meanwhile, so its lease is
    renewed as soon as Postgres answers again, before any reaper may take it. `charged`:
    whether the job may hold a TPM charge to settle once recorded (False: no round trip)."""
    # The job's last events out first (the publisher's sender thread), so its stream ends
    # before its result is stored, as followers expect; bounded, as Redis may hang.
    context.publisher.flush(PUBLISH_FLUSH_SECONDS)
    deadline = time.monotonic() + RECORD_RETRY_SECONDS
    delay = 0.25
    while True:
        try:
            # With the worker's GroupRecorder, jobs that end together share one statement.
            recorded = (context.recorder.record(lease, record) if context.recorder is not None
                        else record_job(context.sessions, lease, record))
            if recorded and charged:   # the job's token charge meets its usage (none without a usage row)
                used = (record.prompt_tokens + record.completion_tokens) if record.prompt_tokens is not None else 0
                settle_tpm(context, lease.job_id, lease.key_id, used)
            return recorded
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("job %s attempt %d: cannot record the result yet (%s); retrying in %.2g s",
                        lease.job_id, lease.attempt, type(exc).__name__, delay)
            time.sleep(delay)
            delay = min(delay * 2, RECORD_RETRY_MAX_DELAY)


def settle_tpm(context: WorkerContext, job_id: str, key_id: str | None, used_tokens: int) -> None:
    """Settle the job's TPM charge against the tokens it used (rein.jobs.ratelimit.settle_tokens;
    nothing for a job without a charge). Best effort: a charge left unsettled expires."""
    if not key_id:
        return
    try:
        settle_tokens(context.redis, context.keys, job_id, key_id, used_tokens)
    except RedisError as exc:
        log.warning("job %s: could not settle its token charge (%s)", job_id, exc)


def hand_back(context: WorkerContext, message: JobMessage, lease: Lease, *,
              suspicion: Suspicion | None = None) -> str:
    """The attempt was interrupted, not finished: back to queued (the attempt refunded), with a
    new message. `suspicion`: the job was running when its engine died, and is now a suspect
    of that group (rein.worker.suspects)."""
    context.publisher.forget(message.job_id)
    suspect = None if suspicion is None else (suspicion.group, suspicion.size)
    if release_job(context.sessions, lease, suspect=suspect):
        requeue(context, message)
        log.info("job %s attempt %d interrupted%s: handed back to the queue", message.job_id, lease.attempt,
                 "" if suspicion is None else f" by its engine's death (death {lease.deaths_seen + 1}, a "
                 f"suspect of {suspicion.size})")
        return "requeued"
    return "lease lost"


def after_engine_death(context: WorkerContext, message: JobMessage, lease: Lease, runner: Any) -> str:
    """`runner`'s engine died while the job was in it: hand it back as a suspect of its half of the
    jobs present, or fail it when the death isolates it as the cause (rein.worker.suspects). A
    job interrupted meanwhile (lease lost, warm shutdown) is only handed back."""
    if context.jobs.is_interrupted(lease.job_id):
        return hand_back(context, message, lease)
    death = context.roster.death(runner)
    if death.isolates(lease):
        return fail_job(context, lease, f"the engine running this job died {lease.deaths_seen + 1} times, the "
                        f"last time with this job alone in it: the request likely crashes it, and it will not "
                        f"be tried again", "server_error", "crashes_its_worker")
    return hand_back(context, message, lease, suspicion=death.suspicion_of(lease.job_id))


def requeue(context: WorkerContext, message: JobMessage) -> None:
    """A fresh message for the job; if the broker is unreachable, the original message comes
    back after the visibility timeout instead (it could not be acknowledged either)."""
    try:
        enqueue_job(context.app, message)
    except Exception as exc:  # kombu raises transport-specific errors
        log.warning("could not requeue job %s (%s): it returns after the broker's visibility timeout",
                    message.job_id, exc)
