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
jobs it runs.

A cancel that arrives between a task's claim and its submit to the engine finds nothing to
abort yet, so the task checks once more right after the submit. That check costs no round
trip while the listener stays subscribed: every path that requests a cancel first writes
`jobs.cancel_requested_at` (which a claim refuses) and then publishes, so a cancel that the
claim did not see is published after it, and a listener subscribed since before the claim
hears it. The listener remembers the cancels it heard (`heard_since`); only when it was not
subscribed all along does the task read the flag from Redis (rein.worker.tasks).
A job cancelled while queued needs no check of the flag before its claim: the claim itself
refuses it (rein.jobs.claim).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from redis import Redis

from rein.store.channel_listener import ChannelListener
from rein.store.redis_keys import RedisKeys

log = logging.getLogger(__name__)

# How long the listener remembers a cancel it heard (for `heard_since`), and the most it keeps.
HEARD_SECONDS = 600.0
MAX_HEARD = 10_000


class CancelListener:
    """A thread subscribed to the cancel channel (rein.store.channel_listener), calling
    `on_cancel(job_id)` for each message.

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
        self._lock = threading.Lock()
        self._generation = 0                  # subscriptions confirmed so far
        self._heard: dict[str, float] = {}    # job id -> when its cancel was heard (monotonic), oldest first
        self._channel = ChannelListener(redis, keys.cancel_channel(), self._cancel, name="rein-cancel-listener",
                                        on_subscribed=self._resubscribed, wait_seconds=wait_seconds)
        self.subscribed = self._channel.subscribed   # set once Redis confirmed the subscription

    def start(self) -> CancelListener:
        self._channel.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._channel.stop(timeout)

    def mark(self) -> int | None:
        """Taken before claiming a job, for `heard_since`; None while not subscribed."""
        with self._lock:
            return self._generation if self.subscribed.is_set() else None

    def heard_since(self, job_id: str, mark: int | None) -> bool | None:
        """Whether a cancel of `job_id` was heard; None when one may have been missed since
        `mark` (the listener was not subscribed all along): then ask Redis for the flag."""
        with self._lock:
            if job_id in self._heard:
                return True
            if mark is None or mark != self._generation or not self.subscribed.is_set():
                return None
            return False

    def _resubscribed(self) -> None:
        # Called before `subscribed` is set: a mark taken in between is None (ask Redis), never
        # the old generation.
        with self._lock:
            self._generation += 1
        self._check_flags()

    def _cancel(self, data: bytes | str) -> None:
        job_id = data.decode() if isinstance(data, bytes) else str(data)
        # Remembered before the abort: a task that submits its job and then finds nothing
        # here is sure the abort comes after its submit.
        now = time.monotonic()
        with self._lock:
            heard = self._heard
            heard.pop(job_id, None)
            heard[job_id] = now
            while heard and (len(heard) > MAX_HEARD or next(iter(heard.values())) < now - HEARD_SECONDS):
                del heard[next(iter(heard))]
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
