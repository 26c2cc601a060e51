"""A batch's rows in the jobs table: written in bulk through COPY once its file is valid
(`spool_job` while checking, `copy_jobs` at the end, each with its prefix order's `feed_key`),
counted while open (`open_jobs`), their tenants' tokens sent and not finished summed
(`queued_batch_tokens`), and dropped on a cancel or expiry (`drop_batch_jobs`).
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import IO, Any

from redis import Redis
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from rein.core.settings import Settings
from rein.jobs.affinity import FEED_KEY_TOKENS  # prompt tokens the prefix order looks at
from rein.jobs.cancel import request_cancel
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job, new_job_id

OPEN_JOB_STATUSES = ("queued", "running")
COPY_COLUMNS = ("id", "tenant", "key_id", "model", "endpoint", "params", "prompt_token_ids",
                "prompt_tokens", "priority", "batch_id", "custom_id", "batch_line", "feed_key", "requested_tokens",
                "shard")



def feed_key(prompt_token_ids: Sequence[int]) -> bytes:
    """The prompt's first FEED_KEY_TOKENS token ids as big-endian uint32s: the bytes sort as the
    token lists do (a prefix of another sorts first), so ordering lines by it puts those
    sharing a prefix side by side, and Postgres compares it with memcmp."""
    head = prompt_token_ids[:FEED_KEY_TOKENS]
    return struct.pack(f">{len(head)}I", *head)


def spool_job(spool: IO[bytes], row: dict[str, Any]) -> None:
    """Keep one checked line's job row in a temporary file until the whole file is valid (a
    50,000-line batch's token ids are never all held in memory)."""
    pickle.dump(row, spool, protocol=pickle.HIGHEST_PROTOCOL)


def spooled_jobs(spool: IO[bytes]) -> Iterator[dict[str, Any]]:
    """The rows `spool_job` wrote, in order (the spool read from its start)."""
    while True:
        try:
            yield pickle.load(spool)
        except EOFError:
            return


@contextmanager
def copy_jobs(session: Session, shard_of: Callable[[Sequence[int]], int] | None = None
              ) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A function inserting one job row (a dict of COPY_COLUMNS but the id, feed_key and shard)
    through COPY, in the session's transaction: several times faster than INSERTs for a
    50,000-line batch, and rows stream to Postgres as they come. `shard_of`: a line's batch
    queue shard from its prompt (rein.jobs.affinity.PrefixGroups.shard); None: shard 0."""
    from psycopg.types.json import Jsonb

    cursor = session.connection().connection.cursor()
    try:
        with cursor.copy(f"COPY jobs ({', '.join(COPY_COLUMNS)}) FROM STDIN") as copy:
            def write(row: dict[str, Any]) -> None:
                prompt = row["prompt_token_ids"]
                row = row | {"id": new_job_id(), "params": Jsonb(row["params"]), "feed_key": feed_key(prompt),
                             "shard": shard_of(prompt) if shard_of is not None else 0}
                copy.write_row([row[column] for column in COPY_COLUMNS])

            yield write
    finally:
        cursor.close()


def open_jobs(session: Session, batch_id: str) -> int:
    return session.scalar(select(func.count()).where(Job.batch_id == batch_id,
                                                     Job.status.in_(OPEN_JOB_STATUSES))) or 0


def queued_batch_tokens(session: Session, tenants: Collection[str]) -> dict[str, int]:
    """Tenant -> the tokens (`requested_tokens`; a line copied before it existed: its prompt) of
    its batch lines sent to a queue and not finished, waiting or running (a partial index holds
    just those lines)."""
    if not tenants:
        return {}
    rows = session.execute(
        select(Job.tenant, func.sum(func.coalesce(Job.requested_tokens, Job.prompt_tokens)))
        .where(Job.tenant.in_(list(tenants)), Job.batch_id.is_not(None), Job.sent_at.is_not(None),
               Job.status.in_(OPEN_JOB_STATUSES))
        .group_by(Job.tenant))
    return {tenant: int(tokens or 0) for tenant, tokens in rows}


def drop_batch_jobs(session: Session, redis: Redis, keys: RedisKeys, settings: Settings, batch_id: str) -> int:
    """Cancel the batch's queued jobs and abort its running ones; how many were aborted.

    Queued first, then running: a job a worker claims between the two statements is
    caught by the second. Idempotent: a running job is signalled once (its
    cancel_requested_at is set then), and queued ones are already gone the next time.
    """
    session.execute(update(Job).where(Job.batch_id == batch_id, Job.status == "queued")
                    .values(status="cancelled", finished_at=func.now(), lease_expires_at=None,
                            cancel_requested_at=func.coalesce(Job.cancel_requested_at, func.now()))
                    .execution_options(synchronize_session=False))
    running = list(session.scalars(
        update(Job).where(Job.batch_id == batch_id, Job.status == "running", Job.cancel_requested_at.is_(None))
        .values(cancel_requested_at=func.now()).returning(Job.id).execution_options(synchronize_session=False)))
    for job_id in running:
        request_cancel(redis, keys, job_id, settings.job_timeout_seconds + settings.stream_ttl_seconds)
    return len(running)
