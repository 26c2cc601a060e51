"""Jobs: the tenant-scoped repository.

Every read of a job goes through `get_job_for_tenant` or `list_jobs_for_tenant`, which
filter by the caller's tenant: another tenant's job is simply not found (404, never 403,
which would reveal that it exists). How a job is created: rein.api.intake.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select, tuple_, update
from sqlalchemy.orm import Session, selectinload

from rein.batches.schemas import MAX_METADATA_KEY_LEN, MAX_METADATA_VALUE_LEN
from rein.jobs.errors import APIError, not_found
from rein.jobs.fields import MAX_METADATA_PAIRS
from rein.openai.images import without_image_data
from rein.store.tables import FINISHED_JOB_STATUSES, Job

# -- the repository: every tenant-scoped query ------------------------------------------------


def get_job_for_tenant(session: Session, tenant: str, job_id: str, *, for_update: bool = False,
                       batch_lines: bool = True) -> Job:
    """The tenant's job with its result and usage loaded; APIError 404 when it is not theirs,
    403 when it is a batch line and `batch_lines` is False (the key lacks the `batch` scope)."""
    query = (select(Job).where(Job.id == job_id, Job.tenant == tenant)
             .options(selectinload(Job.result), selectinload(Job.usage)))
    if for_update:
        query = query.with_for_update(of=Job)
    job = session.scalars(query).one_or_none()
    if job is None:
        raise not_found("job", job_id)
    if job.batch_id is not None and not batch_lines:
        raise batch_scope_error(f"job {job_id} is a line of batch {job.batch_id}")
    return job


def batch_scope_error(what: str) -> APIError:
    return APIError(403, f"API scope is not declared: batch ({what}; batch lines need a key with the "
                         f"batch scope)", type="permission_error", code="insufficient_scope")


def find_job_by_idempotency_key(session: Session, tenant: str, idempotency_key: str) -> Job | None:
    return session.scalars(select(Job).where(Job.tenant == tenant,
                                             Job.idempotency_key == idempotency_key)).one_or_none()


def list_jobs_for_tenant(session: Session, tenant: str, limit: int, after: str | None = None, *,
                         status: str | None = None, batch_id: str | None = None,
                         batch_lines: bool = True) -> tuple[list[Job], bool]:
    """The tenant's jobs newest first, `limit` of them after the job `after`, optionally only
    those of one status and/or one batch; (jobs, has_more). Without `batch_lines` (a key
    lacking the `batch` scope) batch lines are left out, and asking for a batch's is a 403."""
    query = select(Job).where(Job.tenant == tenant)
    if not batch_lines:
        if batch_id is not None:
            raise batch_scope_error(f"the lines of batch {batch_id}")
        query = query.where(Job.batch_id.is_(None))
    if status is not None:
        query = query.where(Job.status == status)
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    if after is not None:
        cursor = session.execute(select(Job.created_at, Job.id)
                                 .where(Job.id == after, Job.tenant == tenant)).one_or_none()
        if cursor is None:
            raise APIError(400, f"after: no job with id '{after}' to page after", param="after",
                           code="invalid_cursor")
        query = query.where(tuple_(Job.created_at, Job.id) < tuple_(cursor.created_at, cursor.id))
    jobs = list(session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
                                .options(selectinload(Job.result), selectinload(Job.usage))))
    return jobs[:limit], len(jobs) > limit


def request_job_cancel(session: Session, tenant: str, job_id: str, *, batch_lines: bool = True) -> tuple[Job, bool]:
    """Mark the tenant's job as cancel-requested (a queued one becomes cancelled at once).

    Returns (job, cancelled_while_queued). A finished job is left as it is. The conditional
    UPDATE on status 'queued' races safely with a worker's claim, which needs
    cancel_requested_at to be NULL: exactly one of the two wins.
    """
    job = get_job_for_tenant(session, tenant, job_id, batch_lines=batch_lines)
    if job.status in FINISHED_JOB_STATUSES:
        return job, False
    now = session.scalar(select(func.now()))
    queued = session.execute(
        update(Job).where(Job.id == job_id, Job.tenant == tenant, Job.status == "queued")
        .values(status="cancelled", finished_at=now, lease_expires_at=None,
                cancel_requested_at=func.coalesce(Job.cancel_requested_at, now))
        .returning(Job.id).execution_options(synchronize_session=False)).one_or_none() is not None
    if not queued:
        session.execute(update(Job).where(Job.id == job_id, Job.tenant == tenant,
                                          Job.cancel_requested_at.is_(None))
                        .values(cancel_requested_at=now).execution_options(synchronize_session=False))
    session.commit()
    session.expire_all()
    return get_job_for_tenant(session, tenant, job_id), queued


def same_request_or_conflict(job: Job, endpoint: str, body: dict[str, Any],
                             metadata: dict[str, str] | None) -> Job:
    """The job an Idempotency-Key names, if it was created by this same request; 409 otherwise
    (reusing a key for a different request is a client bug that must not pass silently)."""
    # (the job keeps the body without its data-URL images: compared the same way)
    if job.endpoint != endpoint or (job.params or {}).get("body") != without_image_data(body) \
            or dict(job.metadata_ or {}) != dict(metadata or {}):
        raise APIError(409, f"This Idempotency-Key was already used for a different request (job "
                            f"{job.id}). Use a new key for a new request.", param="Idempotency-Key",
                       type="invalid_request_error", code="idempotency_key_reused")
    return job


def seconds_between(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 6)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """The limits on a job's or a batch's metadata, as OpenAI's: at most MAX_METADATA_PAIRS
    pairs, keys of at most MAX_METADATA_KEY_LEN characters, values of at most
    MAX_METADATA_VALUE_LEN (APIError 400 naming `metadata`)."""
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise APIError(400, f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}",
                       param="metadata", code="invalid_value")
    for name, value in metadata.items():
        if len(name) > MAX_METADATA_KEY_LEN or len(value) > MAX_METADATA_VALUE_LEN:
            raise APIError(400, f"metadata keys are at most {MAX_METADATA_KEY_LEN} characters and values at "
                                f"most {MAX_METADATA_VALUE_LEN}; '{name[:80]}' is longer",
                           param="metadata", code="invalid_value")
