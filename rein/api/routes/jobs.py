"""Async jobs: POST /v1/jobs, GET /v1/jobs/{id}, GET /v1/jobs, cancel, and the SSE events."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from redis import Redis
from sqlalchemy.orm import Session
from starlette.types import Receive, Scope, Send

from rein.api.checked_route import CheckedRoute
from rein.api.conventions import set_request_id, set_response_headers
from rein.api.deps import AsyncRedisDep, InferenceKey, RedisDep, SessionDep, SettingsDep
from rein.api.intake import MAX_IDEMPOTENCY_KEY_LEN, JobIntake, NewJob
from rein.api.jobs import (
    batch_scope_error,
    get_job_for_tenant,
    list_jobs_for_tenant,
    request_job_cancel,
    seconds_between,
)
from rein.api.schemas import (
    ErrorResponse,
    JobCreate,
    JobCreated,
    JobError,
    JobList,
    JobPublic,
    JobResponse,
    JobStatus,
    JobTimings,
    JobUsage,
)
from rein.api.streams import StreamSlots, follow_events, job_event_stream
from rein.core.logging import log_context
from rein.core.settings import Settings
from rein.jobs.cancel import request_cancel
from rein.jobs.errors import APIError
from rein.jobs.ratelimit import settle_tokens
from rein.jobs.results import response_body
from rein.openai.response import usage_body
from rein.store.keys import KeyInfo
from rein.store.messages import STREAM_FIELD, TokenEvent, event_id
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=CheckedRoute)

MAX_EVENT_ID = 2**63 - 1
# An event's `id:` (its sequence number), or the Redis stream id `<seq>-0`; empty: from the start.
_EVENT_ID = re.compile(r"^(?:([0-9]{1,19})(?:-[0-9]{1,19})?)?$")
_ERRORS = {401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}
# A key refused a stream for holding REIN_MAX_STREAMS_PER_KEY may retry this soon: streams end often.
STREAM_RETRY_AFTER = 2


def job_public(job: Job) -> JobPublic:
    """The public view of a job row (with its result and usage loaded)."""
    usage = job.usage
    response = None
    if job.status == "succeeded" and job.result is not None:
        response = JobResponse(status_code=200, body=response_body(
            job, job.result, usage.cached_tokens if usage else 0, usage.reasoning_tokens if usage else None))
    error = JobError(**{k: job.error.get(k) for k in ("message", "type", "code")}) \
        if job.status == "failed" and job.error else None
    return JobPublic(
        id=job.id, status=job.status, model=job.model, endpoint=job.endpoint, created_at=job.created_at,
        batch_id=job.batch_id, custom_id=job.custom_id,
        metadata=dict(job.metadata_ or {}), prompt_tokens=job.prompt_tokens,
        cancel_requested_at=job.cancel_requested_at,
        timings=JobTimings(
            queued_at=job.queued_at, started_at=job.started_at, first_token_at=job.first_token_at,
            finished_at=job.finished_at,
            queue_seconds=seconds_between(job.queued_at, job.started_at),
            time_to_first_token_seconds=seconds_between(job.queued_at, job.first_token_at),
            total_seconds=seconds_between(job.queued_at, job.finished_at)),
        usage=JobUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                       total_tokens=usage.prompt_tokens + usage.completion_tokens,
                       cached_tokens=usage.cached_tokens, reasoning_tokens=usage.reasoning_tokens) if usage else None,
        response=response, error=error)


@router.post("", status_code=202, response_model=JobCreated,
             responses={**_ERRORS, 400: {"model": ErrorResponse}, 409: {"model": ErrorResponse},
                        429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
async def create_job(payload: JobCreate, request: Request, key: InferenceKey,
                     idempotency_key: Annotated[str | None, Header(
                         alias="Idempotency-Key", json_schema_extra={
                             "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY_LEN})] = None,
                     ) -> JobCreated:
    """Queue a job; 202 with its id. A retry with the same Idempotency-Key returns the same job;
    the same key with a different request is 409 `idempotency_key_reused`."""
    with log_context(key_id=key.key_id, model=payload.body.get("model")):
        job, prepared = await intake_of(request).submit(key, payload.endpoint, payload.body, metadata=payload.metadata,
                                            idempotency_key=idempotency_key, body_bytes=body_bytes(request))
        log_job_accepted(job, reused=prepared is None)
    note_job(request, job)
    return JobCreated(id=job.id, status=job.status)


def note_job(request: Request, job: Job | NewJob) -> None:
    """The response names the job (x-request-id) and the key's rate-limit counters after it
    was admitted (x-ratelimit-*; none for a job returned again for its Idempotency-Key)."""
    set_request_id(request, job.id)
    state = getattr(job, "rate_limit", None)
    if state is not None:
        set_response_headers(request, state.headers())


def intake_of(request: Request) -> JobIntake:
    """The process's JobIntake (from the app state, not a dependency: one resolution less on
    the intake routes)."""
    return request.app.state.intake


def body_bytes(request: Request) -> int | None:
    """The request body's declared size; None when it was not declared (chunked)."""
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


def log_job_accepted(job: Job | NewJob, *, reused: bool = False) -> None:
    """The API's one line about a job: its ids and sizes, never the prompt (grep the job id)."""
    with log_context(job_id=job.id, key_id=job.key_id, model=job.model):
        if reused:
            log.info("job %s returned again for its Idempotency-Key", job.id)
        else:
            log.info("job %s accepted: %s, %d prompt tokens, priority %d", job.id, job.endpoint,
                     job.prompt_tokens, job.priority)


@router.get("", response_model=JobList, responses=_ERRORS)
def list_jobs(session: SessionDep, key: InferenceKey,
              limit: Annotated[int, Query(ge=1, le=100)] = 20,
              after: Annotated[str | None, Query(description="A job id: list the jobs older than it.")] = None,
              status: Annotated[JobStatus | None, Query(description="Only jobs in this status.")] = None,
              batch_id: Annotated[str | None, Query(
                  description="Only the jobs of this batch (one per input line).")] = None,
              ) -> JobList:
    """The caller's jobs, newest first: those sent to POST /v1/jobs or the OpenAI endpoints,
    and, for a key with the `batch` scope, the lines of their batches."""
    jobs, has_more = list_jobs_for_tenant(session, key.tenant, limit, after, status=status, batch_id=batch_id,
                                          batch_lines="batch" in key.scopes)
    return JobList(data=[job_public(job) for job in jobs], first_id=jobs[0].id if jobs else None,
                   last_id=jobs[-1].id if jobs else None, has_more=has_more)


@router.get("/{job_id}", response_model=JobPublic, responses=_ERRORS)
def get_job(job_id: str, session: SessionDep, key: InferenceKey) -> JobPublic:
    """Status, timings, usage and, when it succeeded, the response body."""
    return job_public(get_job_for_tenant(session, key.tenant, job_id, batch_lines="batch" in key.scopes))


@router.post("/{job_id}/cancel", response_model=JobPublic, responses=_ERRORS)
def cancel_job(job_id: str, session: SessionDep, key: InferenceKey, redis: RedisDep,
               settings: SettingsDep) -> JobPublic:
    """Cancel a job: a queued one is cancelled at once, a running one within an engine step."""
    return job_public(cancel_job_of(session, redis, settings, key.tenant, job_id, batch_lines="batch" in key.scopes))


def cancel_job_of(session: Session, redis: Redis, settings: Settings, tenant: str, job_id: str, *,
                  batch_lines: bool = True) -> Job:
    """The cancel path (POST /v1/jobs/{id}/cancel, and a synchronous request whose client went
    away): a queued job is cancelled at once, its stream ended and its token charge given
    back; a running one is aborted by its worker within an engine step (rein.worker.cancel),
    which records the tokens it used."""
    job, was_queued = request_job_cancel(session, tenant, job_id, batch_lines=batch_lines)
    if job.status not in ("succeeded", "failed") or was_queued:
        keys = RedisKeys.from_settings(settings)
        request_cancel(redis, keys, job.id, settings.job_timeout_seconds + settings.stream_ttl_seconds)
        if was_queued:
            # No worker will run it, so the API ends its stream (event 1: nothing ran before).
            final = TokenEvent(seq=1, text="", finish_reason="abort",
                               usage=usage_body(0, 0))
            pipe = redis.pipeline(transaction=False)
            stream = keys.job_stream(job.id)
            pipe.xadd(stream, {STREAM_FIELD: final.to_json()}, id=event_id(1))
            pipe.publish(keys.job_channel(job.id), final.to_json())
            pipe.expire(stream, settings.stream_ttl_seconds)
            pipe.execute(raise_on_error=False)
            settle_tokens(redis, keys, job.id, job.key_id, 0)   # nothing ran: nothing is owed
    return job


@router.get("/{job_id}/events", responses={**_ERRORS, 200: {
    "content": {"text/event-stream": {}},
    "description": "SSE: `id: <seq>` and `data: {seq, text, token_ids[, finish_reason, usage, error]}` "
                   "per event; reconnect with Last-Event-ID to resume."}})
async def job_events(job_id: str, request: Request, key: InferenceKey, redis: AsyncRedisDep,
                     settings: SettingsDep,
                     last_event_id: Annotated[str | None, Header(
                         alias="Last-Event-ID", json_schema_extra={"pattern": _EVENT_ID.pattern})] = None,
                     ) -> StreamingResponse:
    """The job's token events as Server-Sent Events, from Last-Event-ID on."""
    sessions = request.app.state.sessions

    batch_lines = "batch" in key.scopes

    def load() -> Job | None:
        with sessions() as session:
            try:
                return get_job_for_tenant(session, key.tenant, job_id)
            except APIError:
                return None

    job = await run_in_threadpool(load)
    if job is None:
        raise APIError(404, f"No job found with id '{job_id}'.", code="not_found")
    if job.batch_id is not None and not batch_lines:
        raise batch_scope_error(f"job {job_id} is a line of batch {job.batch_id}")
    last = 0
    if last_event_id:
        match = _EVENT_ID.fullmatch(last_event_id.strip())
        last = int(match.group(1)) if match else -1
        if not 0 <= last <= MAX_EVENT_ID:   # a Redis stream id is a 64-bit number
            raise APIError(400, f"Last-Event-ID must be an event id (an integer from 0 to {MAX_EVENT_ID}, "
                                f"as sent in the events' `id:` lines), got {last_event_id[:40]!r}",
                           param="Last-Event-ID", code="invalid_value")
    release = take_stream_slot(request, key)   # nothing below raises before the response owns it
    events = follow_events(redis, RedisKeys.from_settings(settings), job_id, last,
                           lambda: run_in_threadpool(load))
    return SlotStreamingResponse(job_event_stream(events), release, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def take_stream_slot(request: Request, key: KeyInfo) -> Callable[[], None]:
    """One of the key's event stream slots (rein.api.streams.StreamSlots), or 429
    `too_many_streams` with Retry-After. Returns the slot's release, which may be called any
    number of times (it releases once)."""
    slots: StreamSlots = request.app.state.stream_slots
    if not slots.acquire(key.key_id):
        raise APIError(429, f"This key already holds {slots.per_key} event streams open on this server, its "
                            f"limit (REIN_MAX_STREAMS_PER_KEY). Close a stream or retry after "
                            f"{STREAM_RETRY_AFTER} s; GET /v1/jobs/{{id}} gives a job's result without a stream.",
                       type="requests", code="too_many_streams",
                       headers={"Retry-After": str(STREAM_RETRY_AFTER)})
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            slots.release(key.key_id)

    return release


class SlotStreamingResponse(StreamingResponse):
    """A StreamingResponse that holds a stream slot and gives it back when the stream ends, for
    any reason: its last chunk sent, an error, the client gone (the send fails or the task is
    cancelled), or the response run but its body never started.

    `on_abandon`, when given, is called (once, synchronously: it must not block) when the
    response ends before its content did — the client went away mid-stream."""

    def __init__(self, content: AsyncIterator[str], release: Callable[[], None], *,
                 on_abandon: Callable[[], None] | None = None, **kwargs: Any) -> None:
        self._completed = False
        super().__init__(_releasing(self._watch(content), release), **kwargs)
        self._release = release
        self._on_abandon = on_abandon

    async def _watch(self, content: AsyncIterator[str]) -> AsyncIterator[str]:
        async for chunk in content:
            yield chunk
        self._completed = True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
            if not self._completed and self._on_abandon is not None:
                self._on_abandon()


async def _releasing(chunks: AsyncIterator[str], release: Callable[[], None]) -> AsyncIterator[str]:
    """`chunks` (an async generator), releasing the slot as soon as they end or this is closed,
    and closing them then."""
    try:
        async with aclosing(chunks) as closing:
            async for chunk in closing:
                yield chunk
    finally:
        release()
