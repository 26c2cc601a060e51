"""Tenant-scoped reads of files and batches, and their public views.

Every read of a file or a batch goes through these functions, which filter by the caller's
tenant: another tenant's object is simply not found (404, never 403); so is a file past its
`expires_at`. A batch's
`request_counts` and `usage` are computed from its jobs when read (a GROUP BY on the
`(batch_id, status)` index and a join to usage), so they are live while it runs and never
drift from the jobs themselves.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import func, or_, select, tuple_
from sqlalchemy.orm import Session

from rein.batches.schemas import (
    BatchErrors,
    BatchObject,
    BatchRequestCounts,
    BatchUsage,
    FileObject,
    InputTokensDetails,
    OutputTokensDetails,
)
from rein.jobs.errors import APIError, not_found
from rein.store.tables import Batch, File, Job, Usage

Row = TypeVar("Row", File, Batch)


def file_not_expired() -> Any:
    """The files whose `expires_at` has not passed: an expired file is not found from then on,
    whether or not the expiry sweep (rein.jobs.retention) has deleted it yet."""
    return or_(File.expires_at.is_(None), File.expires_at > func.now())


def get_file_for_tenant(session: Session, tenant: str, file_id: str) -> File:
    file = session.scalars(select(File).where(File.id == file_id, File.tenant == tenant,
                                              file_not_expired())).one_or_none()
    if file is None:
        raise not_found("file", file_id)
    return file


def get_batch_for_tenant(session: Session, tenant: str, batch_id: str) -> Batch:
    batch = session.scalars(select(Batch).where(Batch.id == batch_id, Batch.tenant == tenant)).one_or_none()
    if batch is None:
        raise not_found("batch", batch_id)
    return batch


def list_for_tenant(session: Session, table: type[Row], tenant: str, limit: int, after: str | None,
                    *filters: Any, order: str = "desc") -> tuple[list[Row], bool]:
    """The tenant's files or batches, newest first (`order` "asc": oldest first), `limit` of them
    after the one `after`."""
    query = select(table).where(table.tenant == tenant, *filters)
    if after is not None:
        cursor = session.execute(select(table.created_at, table.id)
                                 .where(table.id == after, table.tenant == tenant)).one_or_none()
        if cursor is None:
            raise APIError(400, f"after: no {table.__tablename__[:-1]} with id '{after}' to page after "
                                "(pass the id of the last object of the previous page)",
                           param="after", code="invalid_cursor")
        key, mark = tuple_(table.created_at, table.id), tuple_(cursor.created_at, cursor.id)
        query = query.where(key > mark if order == "asc" else key < mark)
    ordering = (table.created_at, table.id) if order == "asc" else (table.created_at.desc(), table.id.desc())
    rows = list(session.scalars(query.order_by(*ordering).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


def request_counts(session: Session, batch_ids: list[str]) -> dict[str, tuple[int, int]]:
    """batch id -> (completed, failed) from its jobs; cancelled and expired requests count as failed."""
    if not batch_ids:
        return {}
    rows = session.execute(
        select(Job.batch_id,
               func.count().filter(Job.status == "succeeded"),
               func.count().filter(Job.status.in_(("failed", "cancelled"))))
        .where(Job.batch_id.in_(batch_ids)).group_by(Job.batch_id))
    return {row[0]: (row[1], row[2]) for row in rows}


def batch_usage(session: Session, batch_ids: list[str]) -> dict[str, tuple[int, int, int, int]]:
    """batch id -> (prompt, completion, cached, reasoning) tokens billed for its jobs so far."""
    if not batch_ids:
        return {}
    rows = session.execute(
        select(Job.batch_id, func.sum(Usage.prompt_tokens), func.sum(Usage.completion_tokens),
               func.sum(Usage.cached_tokens), func.sum(Usage.reasoning_tokens))
        .join(Usage, Usage.job_id == Job.id)
        .where(Job.batch_id.in_(batch_ids)).group_by(Job.batch_id))
    return {row[0]: (int(row[1] or 0), int(row[2] or 0), int(row[3] or 0), int(row[4] or 0)) for row in rows}


def _ts(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_public(file: File) -> FileObject:
    return FileObject(id=file.id, bytes=file.bytes, created_at=_ts(file.created_at), filename=file.filename,
                      purpose=file.purpose, expires_at=_ts(file.expires_at))


def batches_public(session: Session, batches: list[Batch]) -> list[BatchObject]:
    """Public views of batches, with request counts and usage in two queries for all of them."""
    ids = [b.id for b in batches]
    counts = request_counts(session, ids)
    usage = batch_usage(session, ids)
    return [_batch_public(b, counts.get(b.id, (0, 0)), usage.get(b.id, (0, 0, 0, 0))) for b in batches]


def batch_public(session: Session, batch: Batch) -> BatchObject:
    return batches_public(session, [batch])[0]


def _batch_public(batch: Batch, counts: tuple[int, int], usage: tuple[int, int, int, int]) -> BatchObject:
    prompt, completion, cached, reasoning = usage
    errors = BatchErrors(data=batch.errors.get("data", [])) if batch.errors else None
    return BatchObject(
        id=batch.id, endpoint=batch.endpoint, model=batch.model, errors=errors,
        input_file_id=batch.input_file_id, completion_window=batch.completion_window, status=batch.status,
        output_file_id=batch.output_file_id, error_file_id=batch.error_file_id,
        created_at=_ts(batch.created_at), in_progress_at=_ts(batch.in_progress_at),
        expires_at=_ts(batch.expires_at), finalizing_at=_ts(batch.finalizing_at),
        completed_at=_ts(batch.completed_at), failed_at=_ts(batch.failed_at),
        expired_at=_ts(batch.expired_at), cancelling_at=_ts(batch.cancelling_at),
        cancelled_at=_ts(batch.cancelled_at),
        request_counts=BatchRequestCounts(total=batch.request_total, completed=counts[0], failed=counts[1]),
        usage=BatchUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(cached_tokens=cached),
                         output_tokens=completion, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                         total_tokens=prompt + completion),
        metadata=dict(batch.metadata_ or {}) or None)


