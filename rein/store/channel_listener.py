"""A thread subscribed to one Redis pub/sub channel, subscribing again whenever Redis comes back.

The worker's cancel listener (rein.worker.cancel) and the batch managers' event listener
(rein.batches.wakeup) are both this loop with their own callbacks. Pub/sub delivers only to
connections subscribed at the time, so what a listener misses while Redis is away is for its
owner to recover: `on_subscribed` runs at every confirmed (re)subscription, before `subscribed`
is set, which is where the cancel listener checks the flags of the jobs it runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from redis import Redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

# Reconnection backoff after Redis errors: doubled from the first to the last, seconds.
FIRST_BACKOFF = 0.1
MAX_BACKOFF = 5.0


class ChannelListener:
    """Calls `on_message(data)` for each message on `channel`, from a thread of its own.

    `subscribed` is set while Redis has confirmed the subscription and cleared when the
    connection fails. `wait_seconds` bounds each blocking read, and so how long `stop()`
    waits; it stays well under redis-py's socket timeout.
    """

    def __init__(self, redis: Redis, channel: str, on_message: Callable[[bytes | str], None], *, name: str,
                 on_subscribed: Callable[[], None] | None = None, wait_seconds: float = 0.5) -> None:
        self.redis = redis
        self.channel = channel
        self.on_message = on_message
        self.on_subscribed = on_subscribed
        self.wait_seconds = wait_seconds
        self.name = name
        self.subscribed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ChannelListener:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stop.is_set():
            # Subscribe confirmations are read here: subscribed means Redis has the subscription.
            pubsub = self.redis.pubsub(ignore_subscribe_messages=False)
            try:
                pubsub.subscribe(self.channel)
                backoff = FIRST_BACKOFF
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=self.wait_seconds)
                    if message is None:
                        continue
                    if message.get("type") == "message":
                        self._deliver(message["data"])
                    elif message.get("type") == "subscribe":
                        if self.on_subscribed is not None:
                            self.on_subscribed()
                        self.subscribed.set()
            except RedisError as exc:
                self.subscribed.clear()
                log.warning("%s lost Redis (%s); reconnecting in %.1f s", self.name, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)
            finally:
                try:
                    pubsub.close()
                except RedisError:
                    pass
        self.subscribed.clear()

    def _deliver(self, data: bytes | str) -> None:
        try:
            self.on_message(data)
        except Exception:  # one bad message must not end the listener
            log.exception("%s: handling a message failed", self.name)
