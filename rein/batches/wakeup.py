"""Waking the batch managers when batch lines end, instead of waiting for their next poll.

A batch manager polls every REIN_BATCH_POLL_SECONDS (rein.batches.manager). Alone, that poll
bounds a batch twice: its last line's result waits up to a poll for the output file, and its
lines reach the queue at most REIN_BATCH_QUEUE_WINDOW a poll (256 a second by default, which a
GPU worker on a small model drains in a fraction of it). So a worker that has recorded batch
lines says so on `RedisKeys.batch_events()` (`announce_batch_progress`, once per recorded
group), and every manager's `BatchEventListener` wakes its manager, which then feeds the
queue and finishes what ended. The manager keeps at least BATCH_WAKE_MIN_SECONDS between
ticks, so a busy worker costs it a few ticks a second, not one per line.

This is a hint, never the only path: a manager that misses an event (Redis away, the
listener reconnecting) still acts on its next poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError

from rein.core.redis_keys import RedisKeys

log = logging.getLogger(__name__)

# The shortest time between two ticks of a manager woken by batch events.
BATCH_WAKE_MIN_SECONDS = 0.2


def announce_batch_progress(redis: Redis, keys: RedisKeys) -> None:
    """Tell the batch managers that batch lines were recorded (best effort: a lost hint costs
    a poll)."""
    try:
        redis.publish(keys.batch_events(), b"")
    except RedisError as exc:
        log.debug("batch event not published: %s", exc)


class BatchEventListener:
    """A thread subscribed to the batch event channel, calling `on_event()` for each message."""

    def __init__(self, redis: Redis, keys: RedisKeys, on_event: Callable[[], None],
                 wait_seconds: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self.on_event = on_event
        self.wait_seconds = wait_seconds     # a blocking read, well under redis-py's socket timeout
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rein-batch-events", daemon=True)

    def start(self) -> BatchEventListener:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                pubsub.subscribe(self.keys.batch_events())
                backoff = 0.1
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self.wait_seconds)
                    if message is None:
                        continue
                    if message.get("type") == "subscribe":
                        self.subscribed.set()
                    elif message.get("type") == "message":
                        self.on_event()
            except RedisError as exc:
                self.subscribed.clear()
                log.warning("batch event listener lost Redis (%s); reconnecting in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                try:
                    pubsub.close()
                except RedisError:
                    pass
        self.subscribed.clear()
