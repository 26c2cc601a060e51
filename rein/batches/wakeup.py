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
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError

from rein.store.channel_listener import ChannelListener
from rein.store.redis_keys import RedisKeys

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


class BatchEventListener(ChannelListener):
    """A thread subscribed to the batch event channel, calling `on_event()` for each message."""

    def __init__(self, redis: Redis, keys: RedisKeys, on_event: Callable[[], None],
                 wait_seconds: float = 0.5) -> None:
        super().__init__(redis, keys.batch_events(), lambda _data: on_event(), name="rein-batch-events",
                         wait_seconds=wait_seconds)
