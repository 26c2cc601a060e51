"""Cancelling jobs: the request side (for the API) and the worker's listener.

A cancel has two halves, because a job may be queued or running when it comes:

* a flag, `RedisKeys.job_cancel(job_id)`, which a worker checks when it takes the job's
  message: a job cancelled while queued is then skipped (and marked cancelled if the API
  had not done so already);
* a message on `RedisKeys.cancel_channel()` whose payload is the job id: every worker's
  `CancelListener` hears it and aborts the job in its engine, which happens before the
  engine's next step and frees the job's KV blocks at once.

The API's cancel route calls `request_cancel` after setting `jobs.cancel_requested_at`
(and, for a still queued job, `status = 'cancelled'`). Pub/sub delivers only to
listeners connected at the time, so a listener that reconnects checks the flags of the
jobs it runs, and a task checks the flag once more right after it handed the job to the
engine (a cancel that arrived between the claim and the submit).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session

from rein.core.redis_keys import RedisKeys

log = logging.getLogger(__name__)


def request_cancel(redis: Redis, keys: RedisKeys, job_id: str, flag_ttl_seconds: int) -> None:
    """Set the job's cancel flag and tell every worker, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    pipe.set(keys.job_cancel(job_id), "1", ex=flag_ttl_seconds)
    pipe.publish(keys.cancel_channel(), job_id)
    pipe.execute()


def is_cancel_requested(redis: Redis, keys: RedisKeys, job_id: str) -> bool:
    return bool(redis.exists(keys.job_cancel(job_id)))


class CancelListener:
    """A thread subscribed to the cancel channel, calling `on_cancel(job_id)` for each message.

    `running_jobs()` lists the jobs this worker runs; after every (re)subscription their
    flags are checked, so a cancel published while the listener was disconnected still
    lands.
    """

    def __init__(self, redis: Redis, keys: RedisKeys, on_cancel: Callable[[str], None],
                 running_jobs: Callable[[], list[str]] = list, wait_seconds: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self.on_cancel = on_cancel
        self.running_jobs = running_jobs
        self.wait_seconds = wait_seconds
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rein-cancel-listener", daemon=True)

    def start(self) -> CancelListener:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.keys.cancel_channel())
                self.subscribed.set()
                self._check_flags()
                backoff = 0.1
                while not self._stop.is_set():
                    # Blocks on the socket up to wait_seconds: the bound on how long stop() waits.
                    message = pubsub.get_message(timeout=self.wait_seconds)
                    if message is not None and message.get("type") == "message":
                        self._cancel(message["data"])
            except RedisError as exc:
                self.subscribed.clear()
                log.warning("cancel listener lost Redis (%s); reconnecting in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    pubsub.close()
                except RedisError:
                    pass
        self.subscribed.clear()

    def _cancel(self, data: bytes | str) -> None:
        job_id = data.decode() if isinstance(data, bytes) else str(data)
        try:
            self.on_cancel(job_id)
        except Exception:  # one bad cancel must not end the listener
            log.exception("cancelling job %s failed", job_id)

    def _check_flags(self) -> None:
        jobs = list(self.running_jobs())
        if not jobs:
            return
        flags = self.redis.mget([self.keys.job_cancel(job_id) for job_id in jobs])
        for job_id, flag in zip(jobs, flags, strict=True):
            if flag is not None:
                self._cancel(job_id)


def cancel_work_of_key(session: Session, redis: Redis, keys: RedisKeys, key_id: str,
                       flag_ttl_seconds: int) -> tuple[int, int, int]:
    """Cancel what a key started and is not finished (`rein keys revoke --cancel-work`): its
    queued jobs at once, its running jobs within an engine step, its unfinished batches
    through the batch manager (`cancelling`). (queued, running, batches) counts; the caller
    commits. Batch lines are left to their batch's cancel."""
    from sqlalchemy import func, update

    from rein.core.models import Batch, Job

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
