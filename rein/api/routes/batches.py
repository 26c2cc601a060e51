"""The OpenAI Batches API: POST /v1/batches, GET /v1/batches/{id}, GET /v1/batches,
POST /v1/batches/{id}/cancel; and rein's partial views GET /v1/batches/{id}/output and
GET /v1/batches/{id}/errors (the lines so far, while the batch runs). Needs the `batch` scope.

Creating a batch only records it (status `validating`); the batch manager
(rein.batches.manager) validates every line, enqueues and finalizes. A batch counts as one
request against the key's RPM when created; its lines are not counted against RPM or TPM
(they run at batch priority in the capacity interactive traffic leaves, and the manager's
queue window keeps them from filling the queue), but every token they use is in usage. A
tenant whose storage is at its quota (REIN_MAX_TENANT_FILE_BYTES) starts no batch: its output
and error files would add to it (413 storage_quota_exceeded).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import func, update

from rein.api.checked_route import CheckedRoute
from rein.api.conventions import set_response_headers
from rein.api.deps import RedisDep, SessionDep, SessionsDep, SettingsDep
from rein.api.jobs import check_metadata
from rein.api.routes.files import BatchKey, download_response, over_quota
from rein.api.schemas import ErrorResponse
from rein.batches.batch_jobs import drop_batch_jobs
from rein.batches.expiry import default_expiry_seconds
from rein.batches.locks import lock_batch_waiting
from rein.batches.repository import (
    batch_public,
    batches_public,
    get_batch_for_tenant,
    get_file_for_tenant,
    list_for_tenant,
)
from rein.batches.result_files import Kind, batch_line_pages
from rein.batches.schemas import (
    BatchCreate,
    BatchList,
    BatchObject,
)
from rein.jobs.errors import APIError
from rein.jobs.ratelimit import RateLimitExceeded
from rein.jobs.retention import stored_bytes
from rein.store.keys import KeyInfo
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Batch

router = APIRouter(prefix="/v1/batches", tags=["batches"], route_class=CheckedRoute)

CANCEL_LOCK_WAIT_SECONDS = 2.0
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


def _wake_manager(request: Request) -> None:
    manager = getattr(request.app.state, "batch_manager", None)
    if manager is not None:
        manager.wake()


@router.post("", response_model=BatchObject,
             responses={**_ERRORS, 400: {"model": ErrorResponse}, 429: {"model": ErrorResponse}})
def create_batch(payload: BatchCreate, request: Request, session: SessionDep, key: BatchKey,
                 settings: SettingsDep) -> BatchObject:
    """Start a batch from an uploaded file; it is `validating` until every line has been checked."""
    check_metadata(payload.metadata)
    file = get_file_for_tenant(session, key.tenant, payload.input_file_id)
    if file.purpose != "batch":
        raise APIError(400, f"File {file.id} has purpose '{file.purpose}'; a batch needs a file uploaded "
                            "with purpose 'batch'.", param="input_file_id", code="invalid_value")
    # Its output and error files count toward the tenant's storage: none starts on a full quota
    # (else batches over one input file could grow it without end).
    used, quota = stored_bytes(session, key.tenant), settings.max_tenant_file_bytes
    if used.total >= quota:
        raise over_quota(used, quota, this="A new batch (its output and error files count toward your storage)",
                         param="input_file_id")
    try:
        limits = request.app.state.limiter.check(key, 0)     # one request against RPM, no tokens
    except RateLimitExceeded as exc:
        raise APIError(429, exc.message, type=exc.kind, code="rate_limit_exceeded",
                       headers=exc.headers()) from None
    if limits is not None:
        set_response_headers(request, limits.headers())
    # The output files' expiry is fixed now, so a later change of the default leaves this batch's as promised.
    output_expiry = (payload.output_expires_after.seconds if payload.output_expires_after is not None
                     else default_expiry_seconds(settings))
    batch = Batch(tenant=key.tenant, key_id=key.key_id, endpoint=payload.endpoint, input_file_id=file.id,
                  completion_window=payload.completion_window, metadata_=dict(payload.metadata or {}),
                  output_expires_after_seconds=output_expiry,
                  expires_at=func.now() + timedelta(seconds=settings.batch_completion_window_seconds))
    session.add(batch)
    session.commit()
    session.refresh(batch)
    _wake_manager(request)
    return batch_public(session, batch)


@router.get("", response_model=BatchList, responses=_ERRORS)
def list_batches(session: SessionDep, key: BatchKey,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20,
                 after: Annotated[str | None, Query(description="A batch id: list the batches older than it.")]
                 = None) -> BatchList:
    """The caller's batches, newest first."""
    batches, has_more = list_for_tenant(session, Batch, key.tenant, limit, after)
    return BatchList(data=batches_public(session, batches), first_id=batches[0].id if batches else None,
                     last_id=batches[-1].id if batches else None, has_more=has_more)


@router.get("/{batch_id}", response_model=BatchObject, responses=_ERRORS)
def get_batch(batch_id: str, session: SessionDep, key: BatchKey) -> BatchObject:
    """The batch, with live request_counts and usage."""
    return batch_public(session, get_batch_for_tenant(session, key.tenant, batch_id))


@router.post("/{batch_id}/cancel", response_model=BatchObject, responses=_ERRORS)
def cancel_batch(batch_id: str, request: Request, session: SessionDep, key: BatchKey, redis: RedisDep,
                 settings: SettingsDep) -> BatchObject:
    """Cancel: queued requests are dropped, running ones aborted; `cancelling`, then `cancelled`.

    Completed results are kept (in the output file). A batch that already ended, or is
    finalizing, is returned as it is.
    """
    batch = get_batch_for_tenant(session, key.tenant, batch_id)
    moved = session.execute(
        update(Batch).where(Batch.id == batch.id, Batch.status.in_(("validating", "in_progress")))
        .values(status="cancelling", cancelling_at=func.now()).returning(Batch.id)).one_or_none()
    session.commit()
    if moved is not None:
        # Drop at once rather than on the manager's next tick (which repeats it), unless a
        # manager holds the batch for long (validating it): then it is left to the manager.
        if lock_batch_waiting(session, batch.id, CANCEL_LOCK_WAIT_SECONDS):
            drop_batch_jobs(session, redis, RedisKeys.from_settings(settings), settings, batch.id)
            session.commit()
        _wake_manager(request)
    session.expire_all()
    return batch_public(session, get_batch_for_tenant(session, key.tenant, batch_id))


def _lines_response(request: Request, sessions: Any, key: KeyInfo, batch_id: str, kind: Kind) -> StreamingResponse:
    with sessions() as session:
        get_batch_for_tenant(session, key.tenant, batch_id)

    def stream() -> Iterator[bytes]:
        # A page of rows at a time, each in its own short session (rein.batches.result_files).
        for line in batch_line_pages(sessions, lambda session: get_batch_for_tenant(session, key.tenant, batch_id),
                                     kind):
            yield line.encode()

    return download_response(request, key, stream())


@router.get("/{batch_id}/output", responses={**_ERRORS, 200: {"content": {"application/jsonl": {}}}})
def batch_output(batch_id: str, request: Request, sessions: SessionsDep, key: BatchKey) -> StreamingResponse:
    """The output lines of the requests that succeeded so far, in input order (rein only)."""
    return _lines_response(request, sessions, key, batch_id, "output")


@router.get("/{batch_id}/errors", responses={**_ERRORS, 200: {"content": {"application/jsonl": {}}}})
def batch_errors(batch_id: str, request: Request, sessions: SessionsDep, key: BatchKey) -> StreamingResponse:
    """The error lines of the requests that failed so far, in input order (rein only)."""
    return _lines_response(request, sessions, key, batch_id, "errors")
