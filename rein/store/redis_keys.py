"""Every Redis key and channel name rein uses, in one place.

A `prefix` (default "rein") namespaces everything, so tests and several deployments can
share one Redis without colliding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = "rein"

    @classmethod
    def from_settings(cls, settings: Any) -> RedisKeys:
        """Keys under settings.redis_key_prefix (a trailing ':' is the separator added here)."""
        return cls(str(getattr(settings, "redis_key_prefix", "rein")).rstrip(":") or "rein")

    def job_stream(self, job_id: str) -> str:
        """Stream of a job's token events (XADD with id = <seq>-0, capped, expiring after the job)."""
        return f"{self.prefix}:job:{job_id}:events"

    def job_channel(self, job_id: str) -> str:
        """Pub/sub channel with the same events, for direct subscribers."""
        return f"{self.prefix}:job:{job_id}:live"

    def job_cancel(self, job_id: str) -> str:
        """Set when a job is cancelled; the worker checks it when it takes the job."""
        return f"{self.prefix}:job:{job_id}:cancel"

    def cancel_channel(self) -> str:
        """Workers subscribe here to abort running jobs within one engine step."""
        return f"{self.prefix}:cancel"

    def batch_events(self) -> str:
        """Workers publish here when they have recorded batch lines; the batch managers wake at
        once to feed the queue or finish the batch (rein.batches.wakeup)."""
        return f"{self.prefix}:batch-events"

    def lora_events(self) -> str:
        """The API publishes here when a LoRA adapter is registered or unloaded; workers read a
        new one into their host cache at once (rein.worker.adapters)."""
        return f"{self.prefix}:lora-events"

    def queue(self, model: str) -> str:
        """The Celery queue of a served model's interactive jobs (priority below PRIORITY_BATCH)."""
        return f"{self.prefix}.model.{model}"

    def batch_queue(self, model: str, shard: int = 0) -> str:
        """A Celery queue of a served model's batch jobs (priority PRIORITY_BATCH and worse): a
        queue of its own, so that a worker can keep slots for the interactive one; one of
        several shards, by prompt prefix (rein.jobs.affinity), shard 0 under the plain name."""
        name = f"{self.prefix}.model.{model}.batch"
        return f"{name}.{shard}" if shard else name

    def rate_limit(self, key_id: str, kind: str, window: int) -> str:
        return f"{self.prefix}:ratelimit:{key_id}:{kind}:{window}"

    def worker_heartbeat(self, worker: str) -> str:
        """A worker's latest heartbeat JSON, expiring when it stops beating."""
        return f"{self.prefix}:worker:{worker}"

    def workers(self) -> str:
        """Hash worker name -> its last heartbeat JSON, kept after it stops (for `rein top`)."""
        return f"{self.prefix}:workers"
