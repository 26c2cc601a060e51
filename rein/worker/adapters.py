"""The worker's side of LoRA adapters registered at run time: a thread on the API's
announcements (RedisKeys.lora_events, rein.api.routes.lora) that has the engine read a newly
registered adapter of this worker's model into its host cache before its first job comes, and
drop an unloaded one.

Nothing depends on hearing them: every job's message names its adapter's path, which the engine
reads on demand when the adapter is not cached (rein.engine.lora_slots), so a worker that starts
later, or missed an announcement while Redis was away, runs the adapter's jobs all the same.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from redis import Redis

from rein.jobs.adapters import AdapterRef
from rein.store.channel_listener import ChannelListener
from rein.store.redis_keys import RedisKeys

log = logging.getLogger(__name__)


class AdapterListener:
    """Calls `runner().lora_event(event, lora_request)` for each announcement about an adapter of
    `model_name` (`runner`: the engine client running now; the keeper may replace it)."""

    def __init__(self, redis: Redis, keys: RedisKeys, model_name: str, runner: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.runner = runner
        self._channel = ChannelListener(redis, keys.lora_events(), self._announced, name="rein-lora-listener")

    def start(self) -> AdapterListener:
        self._channel.start()
        return self

    def stop(self) -> None:
        self._channel.stop()

    def _announced(self, data: bytes | str) -> None:
        try:
            message = json.loads(data)
            event = message.pop("event")
            adapter = AdapterRef.from_dict(message)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring a malformed LoRA announcement %r: %s", data, exc)
            return
        if adapter.base != self.model_name or event not in ("load", "unload"):
            return
        log.info("LoRA adapter %s %sed for the fleet: %s", adapter.name, event, adapter.path)
        try:
            self.runner().lora_event(event, adapter.lora_request())
        except Exception as exc:   # the engine is down or restarting: its first job reads the adapter
            log.warning("LoRA adapter %s: the %s announcement did not reach the engine (%s)", adapter.name, event, exc)
