"""Cancelling jobs: the flag and the message every worker hears (rein.worker.cancel listens), and a key's work."""

from __future__ import annotations

from redis import Redis
from sqlalchemy import func, update
from sqlalchemy.orm import Session

from rein.store.redis_keys import RedisKeys
from rein.store.tables import Batch, Job


def request_cancel(redis: Redis, keys: RedisKeys, job_id: str, flag_ttl_seconds: int) -> None:
    """Set the job's cancel flag and tell every worker, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.job_cancel(job_id), "1", ex=flag_ttl_seconds)
    pipe.publish(keys.cancel_channel(), job_id)
    pipe.execute()


def is_cancel_requested(redis: Redis, keys: RedisKeys, job_id: str) -> bool:
    return bool(redis.exists(keys.job_cancel(job_id)))


def cancel_work_of_key(session: Session, redis: Redis, keys: RedisKeys, key_id: str,
                       flag_ttl_seconds: int) -> tuple[int, int, int]:
    """Cancel what a key started and is not finished (`rein keys revoke --cancel-work`): its
    queued jobs at once, its running jobs within an engine step, its unfinished batches
    through the batch manager (`cancelling`). (queued, running, batches) counts; the caller
    commits. Batch lines are left to their batch's cancel."""
    queued = session.execute(
        update(Job).where(Job.key_id == key_id, Job.batch_id.is_(None), Job.status == "queued")
        .values(status="cancelled", finished_at=func.now(), lease_expires_at=None,
                cancel_requested_at=func.coalesce(Job.cancel_requested_at, func.now()))
        .execution_options(synchronize_session=False)).rowcount
    running = list(session.scalars(
        update(Job).where(Job.key_id == key_id, Job.batch_id.is_(None), Job.status == "running",
                          Job.cancel_requested_at.is_(None))
        .values(cancel_requested_at=func.now()).returning(Job.id).execution_options(synchronize_session=False)))
    batches = session.execute(
        update(Batch).where(Batch.key_id == key_id, Batch.status.in_(("validating", "in_progress")))
        .values(status="cancelling", cancelling_at=func.now())
        .execution_options(synchronize_session=False)).rowcount
    session.flush()
    for job_id in running:
        request_cancel(redis, keys, job_id, flag_ttl_seconds)
    return queued, len(running), batches
