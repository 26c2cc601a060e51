"""OpenAI-compatible endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses
(run as chat: rein.openai.responses), GET /v1/models (and /v1/models/{model}).

Each request becomes a job like POST /v1/jobs (same validation, limits and queue). Without
`stream`, the route follows the job's event stream to its final event and returns the
body stored in Postgres, exactly what GET /v1/jobs/{id} shows as `response.body`. With
`stream: true` it relays the events as OpenAI chunks.

A client that disconnects before its answer is complete gets its job cancelled through the
cancel path (rein.api.routes.jobs.cancel_job_of), as vLLM aborts such a request: the worker
stops it within an engine step and bills the tokens made so far. (A job submitted with POST
/v1/jobs is meant to outlive its connections: its followers come and go freely.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from rein.api.checked_route import CheckedRoute
from rein.api.deps import (
    AsyncRedisDep,
    CurrentKey,
    InferenceKey,
    RegistryDep,
    SettingsDep,
)
from rein.api.jobs import get_job_for_tenant
from rein.api.responses_sse import responses_event_stream
from rein.api.routes.jobs import (
    SlotStreamingResponse,
    body_bytes,
    cancel_job_of,
    intake_of,
    log_job_accepted,
    note_job,
    take_stream_slot,
)
from rein.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
    ModelPublic,
    ResponsesRequest,
)
from rein.api.streams import StreamEvent, follow_events, openai_chunk_stream
from rein.core.logging import log_context
from rein.engine.request_result import RequestResult
from rein.jobs.errors import INVALID_REQUEST, APIError, error_body
from rein.jobs.registry import ModelEntry
from rein.jobs.results import response_body, with_service_tier
from rein.openai.choices_response import full_response
from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, RESPONSES, generated_as
from rein.openai.reasoning import Reasoning, apply_reasoning
from rein.openai.response import build_response
from rein.openai.response_shape import ResponseShape
from rein.openai.responses import chat_body
from rein.openai.responses_body import response_from_chat
from rein.openai.tools import apply_tool_calls
from rein.store.keys import KeyInfo
from rein.store.redis_keys import RedisKeys
from rein.store.tables import FINISHED_JOB_STATUSES, Job

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"], route_class=CheckedRoute)

# The worker publishes the final event just before it commits the result: how long to wait
# for the commit to show.
RESULT_COMMIT_WAIT_SECONDS = 10.0

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 429, 500, 503)}
_SSE = {"text/event-stream": {}}


@router.post("/chat/completions", response_model=ChatCompletion,
             responses={**_ERRORS, 200: {"content": _SSE}})
async def chat_completions(payload: ChatCompletionRequest, request: Request, key: InferenceKey,
                           redis: AsyncRedisDep, settings: SettingsDep) -> Any:
    """Chat completion; `stream: true` answers with `chat.completion.chunk` SSE and `[DONE]`."""
    return await _complete(CHAT_COMPLETIONS, payload.model_dump(exclude_unset=True), request, key,
                           redis, settings)


@router.post("/completions", response_model=Completion, responses={**_ERRORS, 200: {"content": _SSE}})
async def completions(payload: CompletionRequest, request: Request, key: InferenceKey,
                      redis: AsyncRedisDep, settings: SettingsDep) -> Any:
    """Text completion; `stream: true` answers with `text_completion` SSE chunks and `[DONE]`."""
    return await _complete(COMPLETIONS, payload.model_dump(exclude_unset=True), request, key,
                           redis, settings)


@router.post("/responses", responses={**_ERRORS, 200: {"content": {"application/json": {}, **_SSE}}})
async def responses(payload: ResponsesRequest, request: Request, key: InferenceKey,
                    redis: AsyncRedisDep, settings: SettingsDep) -> Any:
    """OpenAI's Responses API, stateless (rein.openai.responses); `stream: true` answers with its
    SSE events, response.created to response.completed."""
    return await _complete(RESPONSES, payload.model_dump(exclude_unset=True), request, key, redis, settings)


@router.get("/models", response_model=ModelList, responses={401: {"model": ErrorResponse}})
def list_models(key: CurrentKey, registry: RegistryDep, request: Request) -> ModelList:
    """The served models (any valid key), then the LoRA adapters over them, each with its `parent`."""
    created = request.app.state.started_at
    models = [_model_public(entry, created) for entry in registry]
    if registry.adapters is not None:
        for adapter in registry.adapters.registered():
            entry = registry.get(adapter.name)
            if entry is not None:
                models.append(_model_public(entry, created))
    return ModelList(data=models)


@router.get("/models/{model:path}", response_model=ModelPublic,
            responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
def retrieve_model(model: str, key: CurrentKey, registry: RegistryDep, request: Request) -> ModelPublic:
    """One served model or LoRA adapter (the official client's `models.retrieve`)."""
    entry = registry.get(model)
    if entry is None:
        served = ", ".join(e.name for e in registry) or "none"
        raise APIError(404, f"The model '{model}' does not exist (served: {served}).", param="model",
                       code="model_not_found")
    return _model_public(entry, request.app.state.started_at)


def _model_public(entry: ModelEntry, created: int) -> ModelPublic:
    if entry.lora is not None:
        return ModelPublic(id=entry.name, created=created, max_model_len=entry.max_model_len,
                           root=entry.lora.path, parent=entry.lora.base)
    return ModelPublic(id=entry.name, created=created, max_model_len=entry.max_model_len, root=entry.source)


async def _complete(endpoint: str, body: dict[str, Any], request: Request, key: KeyInfo,
                    redis: Any, settings: Any) -> Any:
    # A stream's slot is taken before the job is submitted: a key at its stream limit gets 429
    # with nothing queued, rather than a job it cannot follow (and would retry, running it twice).
    release = take_stream_slot(request, key) if body.get("stream") else None
    try:
        with log_context(key_id=key.key_id, model=body.get("model")):
            job, prepared = await intake_of(request).submit(key, endpoint, body, body_bytes=body_bytes(request))
    except BaseException:
        if release is not None:
            release()
        raise
    log_job_accepted(job)
    note_job(request, job)
    sessions = request.app.state.sessions
    keys = RedisKeys.from_settings(settings)

    def load() -> Job | None:
        with sessions() as session:
            try:
                return get_job_for_tenant(session, key.tenant, job.id)
            except APIError:
                return None

    events = follow_events(redis, keys, job.id, 0, lambda: run_in_threadpool(load))
    shape = ResponseShape.from_dict((job.params or {}).get("shape"))   # n > 1, echo (rein.openai.response_shape)
    if release is not None and endpoint == RESPONSES:
        return SlotStreamingResponse(
            responses_event_stream(events, job_id=job.id, model=job.model, prompt_tokens=job.prompt_tokens,
                                   request_body=body, tool_parser=(job.params or {}).get("tool_parser"),
                                   reasoning=Reasoning.from_dict((job.params or {}).get("reasoning"))),
            release, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            on_abandon=lambda: _abandon_in_background(request, key, job.id))
    if release is not None:
        options = body.get("stream_options") or {}
        return SlotStreamingResponse(
            openai_chunk_stream(events, endpoint=endpoint, job_id=job.id, model=job.model,
                                prompt_tokens=job.prompt_tokens,
                                include_usage=bool(options.get("include_usage")), n=shape.n, echo=shape.echo,
                                request_body=body, tool_parser=(job.params or {}).get("tool_parser"),
                                reasoning=Reasoning.from_dict((job.params or {}).get("reasoning"))),
            release, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
            on_abandon=lambda: _abandon_in_background(request, key, job.id))

    gathered = RequestResult()
    following = asyncio.ensure_future(_follow(events, gathered))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((following, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not following.done():
        # The client went away: nothing will read the answer, so the job stops computing
        # (the tokens made so far are billed). 499: nginx's "client closed request", for the logs.
        following.cancel()
        await run_in_threadpool(_abandon, request, key, job.id)
        return JSONResponse(error_body("The client closed the connection; the job was cancelled.",
                                       INVALID_REQUEST, None, "client_disconnected"), status_code=499)
    final = following.result()
    stored = await _wait_for_record(load)
    if stored is not None:
        return _stored_response(stored)
    if final is None or final.data.get("error"):
        message = (final.data.get("error") if final else None) or "the job ended without a result"
        return JSONResponse(error_body(message, "server_error", None, "job_failed"), status_code=500)
    if endpoint == EMBEDDINGS:   # its vectors are in the record only
        return JSONResponse(error_body("the job's result was not recorded in time; read it at GET /v1/jobs/"
                                       f"{job.id}", "server_error", None, "result_unavailable"), status_code=503)
    # The record did not show in time: the stream holds everything the body needs but logprobs.
    entry = prepared.entry if prepared else None
    cached = ((final.data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    gathered.num_cached_tokens = cached
    first = gathered.choice(0)
    tokenizer = entry.tokenizer if entry else None
    if shape.plain and len(gathered.choices) <= 1:
        response = build_response(generated_as(endpoint), job.id, job.model, job.prompt_tokens, first.text,
                                  first.token_ids, final.data.get("finish_reason"), None, tokenizer, None,
                                  cached_tokens=cached)
    else:
        for choice in gathered.choices.values():
            choice.finish_reason = choice.finish_reason or final.data.get("finish_reason")
        response = full_response(generated_as(endpoint), job.id, job.model, gathered, list(job.prompt_token_ids),
                                 tokenizer, None, shape)
    reasoning = Reasoning.from_dict((job.params or {}).get("reasoning"))
    response = apply_reasoning(response, reasoning, [gathered.choice(i).token_ids for i in sorted(gathered.choices)])
    parser = (job.params or {}).get("tool_parser")
    if endpoint == RESPONSES:
        return JSONResponse(response_from_chat(apply_tool_calls(response, chat_body(body), parser), body, job.id))
    # A JSONResponse as the stored answer is: the response model would add `tool_calls: null`.
    return JSONResponse(with_service_tier(apply_tool_calls(response, body, parser), body, job.priority))


async def _follow(events: AsyncIterator[StreamEvent | None], gathered: RequestResult) -> StreamEvent | None:
    """Read the job's events to the end, gathering each choice's text, token ids and finish
    reason; the final event."""
    final: StreamEvent | None = None
    async with aclosing(events) as closing:
        async for event in closing:
            if event is None:
                continue
            choice = gathered.choice(event.data.get("index", 0))
            choice.text_parts.append(event.data.get("text", ""))
            choice.token_ids.extend(event.data.get("token_ids", []))
            if event.data.get("choice_finish_reason"):
                choice.finish_reason = event.data["choice_finish_reason"]
            if event.final:
                final = event
    return final


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the server's next
    message is `http.disconnect` (uvicorn sends it when the connection closes)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    except Exception:   # no way to tell any more: never report a disconnect that was not seen
        await asyncio.Event().wait()


def _abandon(request: Request, key: KeyInfo, job_id: str) -> None:
    """Cancel a synchronous request's job whose client went away (the cancel route's path)."""
    state = request.app.state
    with state.sessions() as session:
        job = cancel_job_of(session, state.redis, state.settings, key.tenant, job_id)
    with log_context(job_id=job_id, key_id=key.key_id):
        log.info("job %s cancelled: its client disconnected (status %s)", job_id, job.status)


_BACKGROUND: set[asyncio.Future] = set()


def _abandon_in_background(request: Request, key: KeyInfo, job_id: str) -> None:
    """`_abandon` in a thread, from a streaming response's teardown (which may be cancelled)."""
    future = asyncio.get_running_loop().run_in_executor(None, _abandon, request, key, job_id)
    _BACKGROUND.add(future)

    def done(f: asyncio.Future) -> None:
        _BACKGROUND.discard(f)
        if not f.cancelled() and f.exception() is not None:
            log.warning("could not cancel job %s after its client disconnected: %s", job_id, f.exception())

    future.add_done_callback(done)


_NOT_YET: Any = object()


async def _wait_for_record(load: Any) -> Job | None:
    deadline = asyncio.get_running_loop().time() + RESULT_COMMIT_WAIT_SECONDS
    delay = 0.005
    while True:
        try:
            job = await run_in_threadpool(load)
        except SQLAlchemyError:   # Postgres away: the stream's events make the answer instead
            job = None if asyncio.get_running_loop().time() > deadline else _NOT_YET
        if job is None or (job is not _NOT_YET and job.status in FINISHED_JOB_STATUSES):
            return job
        if asyncio.get_running_loop().time() > deadline:
            return None
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.2)


def _stored_response(job: Job) -> Any:
    if job.status == "succeeded" and job.result is not None:
        usage = job.usage
        return JSONResponse(response_body(job, job.result, usage.cached_tokens if usage else 0,
                                          usage.reasoning_tokens if usage else None))
    if job.status == "failed":
        error = job.error or {}
        status = 400 if error.get("type") == "invalid_request_error" else 500
        # A job past its time limit would run out of time again: no retry (4xx: none either).
        headers = {"x-should-retry": "false"} if error.get("code") == "timeout" else None
        return JSONResponse(error_body(error.get("message") or "the job failed",
                                       error.get("type") or "server_error", None, error.get("code")),
                            status_code=status, headers=headers)
    return JSONResponse(error_body("The request was cancelled before it completed.",
                                   "invalid_request_error", None, "cancelled"), status_code=409)
