"""Each message kombu's Redis transport pops goes to the channel that popped it, so that
each channel's prefetch limit holds (the worker's flow control, rein.jobs.queues and
rein.worker.bootstep).

A worker consumes its interactive queue on two channels of one broker connection: Celery's
task consumer (both queues, max_num_seqs + queued slots) and rein's InteractiveConsumer (the
interactive queue alone, `interactive_slots` more; rein.worker.bootstep). Kombu 5.7's
virtual transport keeps one consumer callback per *queue name* for the whole connection
(`Transport._callbacks[queue]`), so the channel that registered last — the interactive
one — received every interactive message, whichever channel's BRPOP took it. Each message
then counted against the interactive channel's prefetch limit and never against the task
consumer's: the task consumer's channel always had credit, sent BRPOP after BRPOP, and the
worker took every waiting interactive message (96 of 96, a second worker added 2 s later ran
6; tests/e2e/test_fleet_flow.py).

Here a channel keeps its own callbacks by queue, and a message read by a channel's BRPOP
goes to that channel's callback: it is counted by that channel's QoS, acknowledged on it,
and restored by it if the channel closes unacknowledged. A message whose channel stopped
consuming its queue while its BRPOP was on the wire goes back to the queue (kombu's own
rule for a message nobody consumes). The connection-wide map still serves the transport's
other paths (fanout, `basic_get`), pointing at a channel that still consumes the queue.
"""

from __future__ import annotations

from typing import Any


def deliver_to_the_popping_channel() -> None:
    """Patch kombu's Redis channel and transport (idempotent; see the module docstring)."""
    from kombu.transport import redis as kombu_redis

    channel_class = kombu_redis.Channel
    if getattr(channel_class, "_rein_own_delivery", False):
        return
    original_consume = channel_class.basic_consume
    original_cancel = channel_class._basic_cancel
    original_read = channel_class._brpop_read
    original_deliver = kombu_redis.Transport._deliver

    def own_callbacks(channel: Any) -> dict[str, Any]:
        return channel.__dict__.setdefault("_rein_callbacks", {})

    def basic_consume(self: Any, queue: str, *args: Any, **kwargs: Any) -> Any:
        result = original_consume(self, queue, *args, **kwargs)
        callback = self.connection._callbacks.get(queue)    # the one this call just set
        if callback is not None:
            own_callbacks(self)[queue] = callback
        return result

    def _basic_cancel(self: Any, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = original_cancel(self, consumer_tag)
        if queue is not None and queue not in self._active_queues:
            own_callbacks(self).pop(queue, None)
            transport = self.connection
            if transport is not None:
                # kombu dropped the connection-wide entry: another channel may still consume it.
                for other in transport.channels:
                    callback = own_callbacks(other).get(queue)
                    if callback is not None:
                        transport._callbacks[queue] = callback
                        break
        return result

    def _brpop_read(self: Any, **options: Any) -> Any:
        transport = self.connection
        outer = transport.__dict__.get("_rein_reading_channel")
        transport._rein_reading_channel = self
        try:
            return original_read(self, **options)
        finally:
            transport._rein_reading_channel = outer

    def _deliver(self: Any, message: Any, queue: str) -> Any:
        reader = self.__dict__.get("_rein_reading_channel")
        if reader is None or not queue:
            return original_deliver(self, message, queue)
        callback = own_callbacks(reader).get(queue)
        if callback is None:
            # Popped just as this channel stopped consuming the queue: back to the queue,
            # on this channel, rather than into another channel's prefetch.
            raw = reader.Message(message, channel=reader)
            reader.qos.append(raw, raw.delivery_tag)
            return reader.basic_reject(raw.delivery_tag, requeue=True)
        return callback(message)

    channel_class.basic_consume = basic_consume
    channel_class._basic_cancel = _basic_cancel
    channel_class._brpop_read = _brpop_read
    kombu_redis.Transport._deliver = _deliver
    channel_class._rein_own_delivery = True
