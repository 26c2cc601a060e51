"""The worker's heartbeat: what `rein top` shows of it, written to Redis every HEARTBEAT_SECONDS.

Each beat sets the worker's own key, which expires with the worker, and its entry in the
workers registry (RedisKeys.workers), which stays: `rein top` shows a worker that stopped
beating as LOST (rein.cli.top forgets it later). A worker that stops on purpose writes a
last `stopped` entry instead.

Each beat also reads the registry back: the workers of this model beating now decide which
batch queue shards this one takes first (rein.jobs.affinity), so a worker added or lost
changes the split within a beat or two.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis import Redis
from redis.exceptions import RedisError

from rein.jobs.affinity import prefer_queues, shard_order
from rein.store.redis_keys import RedisKeys

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
# The workers registry (RedisKeys.workers) outlives its last writer by this long.
WORKER_REGISTRY_TTL_SECONDS = 24 * 3600


class Heartbeat:
    """Beats until `stopping` is set. `engine()`: the engine running now (the engine keeper
    may replace it); `engine_ready` is clear while it is down."""

    def __init__(self, redis: Redis, keys: RedisKeys, worker_name: str, model_name: str,
                 engine: Callable[[], LLMEngine], engine_ready: threading.Event, stopping: threading.Event,
                 started_at: float | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.worker_name = worker_name
        self.model_name = model_name
        self.engine = engine
        self.engine_ready = engine_ready
        self.stopping = stopping
        self.started_at = time.time() if started_at is None else started_at
        self._previous: tuple[float, int, int, float] | None = None   # time and totals at the last beat
        self._shard_order: list[int] = []
        self._thread = threading.Thread(target=self._run, name="rein-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def beat(self) -> dict[str, Any]:
        """What `rein top` shows of this worker (rein.cli.top reads these fields).

        `tokens_per_second` and `step_ms` (mean step duration) cover the time since the
        previous beat; `step_ms` is None when no step ran in it. While the engine is down
        (dead, a new one starting) the state is `down` and there are no engine figures.
        """
        if not self.engine_ready.is_set():
            return {"worker": self.worker_name, "model": self.model_name, "time": time.time(), "state": "down",
                    "started": self.started_at, "interval": HEARTBEAT_SECONDS}
        engine = self.engine()
        stats, now = engine.stats, time.time()
        totals = (now, stats.generation_tokens, stats.steps, stats.step_seconds)
        previous = self._previous or (self.started_at, 0, 0, 0.0)
        self._previous = totals
        elapsed, steps = now - previous[0], stats.steps - previous[2]
        return {"worker": self.worker_name, "model": self.model_name, "time": now, "state": "up",
                "started": self.started_at, "interval": HEARTBEAT_SECONDS,
                "running": engine.num_running, "waiting": engine.num_waiting,
                "max_num_seqs": engine.config.max_num_seqs, "kv_blocks": engine.pool.num_blocks,
                "kv_blocks_free": engine.pool.num_free, "kv_usage": engine.pool.usage,
                "steps": stats.steps, "generation_tokens": stats.generation_tokens,
                "preemptions": stats.preemptions,
                "tokens_per_second": (stats.generation_tokens - previous[1]) / elapsed if elapsed > 0 else 0.0,
                "step_ms": 1000 * (stats.step_seconds - previous[3]) / steps if steps else None}

    def stopped(self) -> None:
        """Take the worker's key away and leave a last registry entry saying it stopped on
        purpose (not LOST). Best effort: Redis may be away."""
        beat = {"worker": self.worker_name, "model": self.model_name, "time": time.time(),
                "state": "stopped", "started": self.started_at, "interval": HEARTBEAT_SECONDS}
        try:
            self.redis.delete(self.keys.worker_heartbeat(self.worker_name))
            self.redis.hset(self.keys.workers(), self.worker_name, json.dumps(beat))
        except RedisError:
            pass

    def take_own_shards_first(self, workers: list[str]) -> None:
        """Order this process's broker channels' queues: interactive, then the batch shards in
        this worker's order among `workers` (rein.jobs.affinity.shard_order)."""
        order = shard_order(self.worker_name, workers)
        if order != self._shard_order:
            self._shard_order = order
            prefer_queues([self.keys.queue(self.model_name),
                           *(self.keys.batch_queue(self.model_name, shard) for shard in order)])
            log.info("batch shards taken in the order %s (%d workers of %s beating)", order,
                     len(set(workers) | {self.worker_name}), self.model_name)

    def _run(self) -> None:
        key = self.keys.worker_heartbeat(self.worker_name)
        while not self.stopping.is_set():
            try:
                beat = json.dumps(self.beat())
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, beat, ex=int(3 * HEARTBEAT_SECONDS))
                pipe.hset(self.keys.workers(), self.worker_name, beat)
                pipe.expire(self.keys.workers(), WORKER_REGISTRY_TTL_SECONDS)
                pipe.hgetall(self.keys.workers())
                registry = pipe.execute()[-1]
                self.take_own_shards_first(live_workers(registry, self.model_name, time.time()))
            except (RedisError, RuntimeError) as exc:   # RuntimeError: engine dicts changed under us
                log.debug("heartbeat skipped: %s", exc)
            self.stopping.wait(HEARTBEAT_SECONDS)


def live_workers(registry: dict[bytes, bytes], model: str, now: float) -> list[str]:
    """The workers of `model` beating now, from the workers registry: entries of that model,
    not stopped, written within three beats."""
    names = []
    for name, raw in registry.items():
        try:
            beat = json.loads(raw)
        except ValueError:
            continue
        if (beat.get("model") == model and beat.get("state") != "stopped"
                and now - float(beat.get("time", 0)) < 3 * HEARTBEAT_SECONDS):
            names.append(name.decode() if isinstance(name, bytes) else name)
    return names
