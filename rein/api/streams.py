"""Following a job's token events, and writing them as SSE.

A worker XADDs each TokenEvent to the job's Redis Stream with the id `<seq>-0`. Reading
with XREAD BLOCK from `<last seq>-0` returns exactly the events after `last seq`, so a
client that reconnects with `Last-Event-ID: N` gets N+1, N+2, ... with no gap and no
repeat. When the stream is gone (expired after the job ended) and the job has finished,
the job is replayed from Postgres as one final event (`"replayed": true`, the whole text:
the per-event split is not kept there; a follower that already forwarded part of the text
gets only the rest). A stream is capped (`Settings.stream_maxlen`): a
client resuming from an event already trimmed gets a final error event
(`"code": "events_expired"`) instead of a silent gap.

A follower waits as long as the job is alive. It survives Redis and Postgres failures: a
read that fails is retried with keepalives meanwhile, and after a Redis restart that lost
the stream, the job's next attempt writes it anew or Postgres has the finished job. An idle
follower also asks Postgres about the job now and then, so a stream that a dead worker left
without its final event cannot keep it waiting; only when nothing can be read for
OUTAGE_SECONDS does it end, with an error event (`"code": "stream_unavailable"`).

Two SSE formats come out of the same events: rein's own for GET /v1/jobs/{id}/events
(`id: <seq>` + the event JSON) and OpenAI's `chat.completion.chunk` / `text_completion`
chunks ending in `data: [DONE]` for `stream: true` on the OpenAI endpoints.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from rein.openai.reasoning import Reasoning, ReasoningStream
from rein.openai.response import usage_body
from rein.openai.tools import stream_for
from rein.store.messages import STREAM_FIELD, event_id
from rein.store.redis_keys import RedisKeys
from rein.store.tables import FINISHED_JOB_STATUSES, Job

# XREAD blocks this long, well under the socket timeout of the API's async Redis client
# (STREAM_SOCKET_TIMEOUT): a read that waits its full block must not look like a dead socket.
BLOCK_MS = 5_000
STREAM_SOCKET_TIMEOUT = 15.0
# An idle follower asks Postgres about its job after STORE_MIN_SECONDS of silence, then at
# doubling intervals up to STORE_CHECK_SECONDS (not at every block: a thousand followers of
# queued jobs would read Postgres hundreds of times a second).
STORE_MIN_SECONDS = 2.0
STORE_CHECK_SECONDS = 15.0
# Neither Redis nor Postgres answering for this long ends a follower with an error event.
OUTAGE_SECONDS = 120.0
RETRY_MIN_SECONDS = 0.25
RETRY_MAX_SECONDS = 2.0
READ_COUNT = 512
KEEPALIVE = ": keepalive\n\n"

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "length"}


class StreamSlots:
    """How many event streams (or downloads) each key holds open in this API process, capped: a
    follower holds a Redis connection (XREAD BLOCK) for as long as it follows, a download a
    thread of the pool, so one key must not take them all (REIN_MAX_STREAMS_PER_KEY,
    REIN_MAX_DOWNLOADS_PER_KEY; beyond them, 429 with Retry-After). Thread-safe: downloads
    end on the thread pool."""

    def __init__(self, per_key: int) -> None:
        self.per_key = per_key
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key_id: str) -> bool:
        """Take a slot for the key; False when it holds per_key already."""
        with self._lock:
            held = self._open.get(key_id, 0)
            if held >= self.per_key:
                return False
            self._open[key_id] = held + 1
            return True

    def release(self, key_id: str) -> None:
        with self._lock:
            held = self._open.get(key_id, 0) - 1
            if held > 0:
                self._open[key_id] = held
            else:
                self._open.pop(key_id, None)

    def held(self, key_id: str) -> int:
        return self._open.get(key_id, 0)


@dataclass
class StreamEvent:
    seq: int
    data: dict[str, Any]

    @property
    def final(self) -> bool:
        return self.data.get("finish_reason") is not None or self.data.get("error") is not None


# Loads the job (tenant already checked) when the stream may be gone; None if it vanished.
JobLoader = Callable[[], Awaitable[Job | None]]


def replay_event(job: Job, seq: int, skip_chars: int = 0, skip_tokens: int = 0) -> StreamEvent | None:
    """A finished job as one final event from Postgres; None while it is not finished.

    `skip_chars` / `skip_tokens`: how much of the text and token ids the client already got
    from the stream, so the event carries only the rest.
    """
    if job.status not in FINISHED_JOB_STATUSES:
        return None
    result, usage = job.result, job.usage
    data: dict[str, Any] = {"seq": seq, "text": result.text[skip_chars:] if result else "",
                            "token_ids": list(result.token_ids[skip_tokens:]) if result else []}
    if job.status == "failed":
        data["error"] = (job.error or {}).get("message") or "the job failed"
        if result is not None:
            data["finish_reason"] = result.finish_reason
    else:
        data["finish_reason"] = result.finish_reason if result else "abort"
    prompt = usage.prompt_tokens if usage else (job.prompt_tokens if result else 0)
    completion = usage.completion_tokens if usage else len(result.token_ids) if result else 0
    data["usage"] = usage_body(prompt, completion, usage.cached_tokens if usage else 0)
    data["replayed"] = True
    return StreamEvent(seq, data)


def replay_events(job: Job, seq: int, forwarded: dict[int, list[int]] | None = None) -> list[StreamEvent]:
    """`replay_event` for any job: a job with several choices (n > 1) is replayed as one event
    per choice (its `index`, the text the client has not had yet, `choice_finish_reason`),
    the last one final. `forwarded`: index -> [characters, token ids] already sent.

    The stored body holds each choice's text but only the first choice's token ids, so the
    replayed events of the other choices carry text alone."""
    forwarded = forwarded or {}
    result = job.result
    stored = (result.response or {}).get("choices") if result is not None else None
    if job.status not in FINISHED_JOB_STATUSES or not stored or len(stored) < 2:
        chars, tokens = forwarded.get(0, (0, 0))
        event = replay_event(job, seq, chars, tokens)
        return [event] if event is not None else []
    final = replay_event(job, seq + len(stored) - 1)
    assert final is not None
    echo = (job.params or {}).get("shape", {}).get("echo")
    events = []
    for position, choice in enumerate(stored):
        index = choice.get("index", position)
        text = (choice["message"].get("content") or "") if "message" in choice else choice.get("text", "")
        if echo and text.startswith(echo):   # the stream carries the completion; the echo is added to it
            text = text[len(echo):]
        chars, tokens = forwarded.get(index, (0, 0))
        data: dict[str, Any] = {"seq": seq + position, "text": text[chars:], "index": index,
                                "token_ids": list(result.token_ids[tokens:]) if index == 0 else [],
                                "choice_finish_reason": choice.get("finish_reason") or "stop"}
        if position == len(stored) - 1:
            data.update({k: v for k, v in final.data.items() if k not in ("seq", "text", "token_ids")})
        else:
            data["replayed"] = True
        events.append(StreamEvent(seq + position, data))
    return events


def gap_event(job_id: str, last_seq: int, first_kept: int) -> StreamEvent:
    """The final event when events after `last_seq` were trimmed from the capped stream."""
    missing = (f"event {last_seq + 1}" if first_kept == last_seq + 2
               else f"events {last_seq + 1} to {first_kept - 1}")
    return StreamEvent(last_seq, {
        "seq": last_seq, "code": "events_expired",
        "error": f"{missing} of job {job_id} are no longer kept: its stream holds only the latest "
                 f"events (REIN_STREAM_MAXLEN). GET /v1/jobs/{job_id} has the whole text once the "
                 f"job has finished."})


async def follow_events(redis: AsyncRedis, keys: RedisKeys, job_id: str, last_seq: int,
                        load_job: JobLoader, block_ms: int = BLOCK_MS) -> AsyncIterator[StreamEvent | None]:
    """The job's events after `last_seq`, ending with the final one; None while idle (keepalive).

    Waits as long as the job is alive (see the module docstring): an idle follower looks at
    the job in Postgres every STORE_CHECK_SECONDS, and a Redis or Postgres that cannot be
    reached is waited out, with keepalives, for up to OUTAGE_SECONDS.
    """
    stream = keys.job_stream(job_id)
    last = last_seq
    forwarded: dict[int, list[int]] = {}     # choice index -> [characters, token ids] this call has yielded
    check_store = True
    first_check = True
    store_due = 0.0                  # time.monotonic() of the next look at the job in Postgres
    store_interval = STORE_MIN_SECONDS
    failing_since: float | None = None
    delay = RETRY_MIN_SECONDS
    while True:
        try:
            if check_store:
                check_store = False
                now = time.monotonic()
                ask_store = now >= store_due
                finished = await _finished_job(redis, stream, load_job, last, ask_store, first_check)
                first_check = False
                if ask_store:   # idle on: look again later and later, up to STORE_CHECK_SECONDS
                    store_due = now + store_interval
                    store_interval = min(store_interval * 2, STORE_CHECK_SECONDS)
                if finished is not None:
                    if finished is not _GONE:
                        for event in replay_events(finished, last + 1, forwarded):
                            yield event
                    return
            response = await redis.xread({stream: event_id(last)}, count=READ_COUNT, block=block_ms)
        except (RedisError, SQLAlchemyError, OSError) as exc:
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > OUTAGE_SECONDS:
                yield unavailable_event(job_id, last, exc)
                return
            yield None
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_SECONDS)
            check_store = True
            continue
        failing_since, delay = None, RETRY_MIN_SECONDS
        if not response:
            check_store = True
            yield None
            continue
        store_due = time.monotonic() + STORE_CHECK_SECONDS    # a live stream needs no look for a while
        store_interval = STORE_MIN_SECONDS
        for entry_id, fields in response[0][1]:
            raw = fields.get(STREAM_FIELD.encode()) or fields.get(STREAM_FIELD)
            data = json.loads(raw)
            seq = int(entry_id.split(b"-")[0] if isinstance(entry_id, bytes) else entry_id.split("-")[0])
            if seq > last + 1:
                # The stream is capped (Settings.stream_maxlen): the events the client needs
                # next were trimmed. Say so rather than skip them silently.
                yield gap_event(job_id, last, seq)
                return
            last = seq
            sent = forwarded.setdefault(data.get("index", 0), [0, 0])
            sent[0] += len(data.get("text") or "")
            sent[1] += len(data.get("token_ids") or ())
            event = StreamEvent(seq, data)
            yield event
            if event.final:
                return


_GONE = object()   # _finished_job: nothing more to send (the job is gone, or the client has its end)


async def _finished_job(redis: AsyncRedis, stream: str, load_job: JobLoader, last: int, ask_store: bool,
                        first_check: bool) -> Any:
    """The finished job whose remaining events must come from Postgres, _GONE, or None (keep
    reading the stream).

    A client resuming past the final event (Last-Event-ID at or after it) has everything:
    nothing more is sent (looked at on the first check). Postgres is asked only when
    `ask_store` (on a backoff, see follow_events): about a job whose stream is missing (not
    written yet, expired, or lost with a Redis that restarted empty), or idle long (an
    attempt whose worker died leaves a stream that no final event will ever end).
    """
    if not (first_check or ask_store):
        return None
    tail = await _last_entry(redis, stream)
    if tail is not None and tail[1] and tail[0] <= last:
        return _GONE
    if not ask_store or (first_check and tail is not None):   # a stream to follow: no need to ask yet
        return None
    job = await load_job()
    if job is None:
        return _GONE
    if job.status not in FINISHED_JOB_STATUSES:
        return None
    # A finished job's final event may be on the stream still: it is read there then.
    if tail is not None and tail[1]:
        return None if tail[0] > last else _GONE
    return job


async def _last_entry(redis: AsyncRedis, stream: str) -> tuple[int, bool] | None:
    """(seq, final) of the stream's last event; None when there is no stream."""
    entries = await redis.xrevrange(stream, count=1)
    if not entries:
        return None
    entry_id, fields = entries[0]
    raw = fields.get(STREAM_FIELD.encode()) or fields.get(STREAM_FIELD)
    seq = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return seq, StreamEvent(seq, json.loads(raw)).final


def unavailable_event(job_id: str, last_seq: int, exc: BaseException) -> StreamEvent:
    """The final event when the job's events cannot be read for OUTAGE_SECONDS."""
    return StreamEvent(last_seq, {
        "seq": last_seq, "code": "stream_unavailable",
        "error": f"the events of job {job_id} could not be read for {OUTAGE_SECONDS:.0f} s "
                 f"({type(exc).__name__}); the job itself goes on: GET /v1/jobs/{job_id} has its result "
                 f"once it has finished, or reconnect with Last-Event-ID: {last_seq}."})


def sse(data: str, event_id_: int | None = None) -> str:
    head = f"id: {event_id_}\n" if event_id_ is not None else ""
    return f"{head}data: {data}\n\n"


async def job_event_stream(events: AsyncIterator[StreamEvent | None]) -> AsyncIterator[str]:
    """rein's SSE: `id: <seq>` and the event JSON per event."""
    async for event in events:
        if event is None:
            yield KEEPALIVE
        else:
            yield sse(json.dumps(event.data, ensure_ascii=False, separators=(",", ":")), event.seq)


async def openai_chunk_stream(events: AsyncIterator[StreamEvent | None], *, endpoint: str, job_id: str,
                              model: str, prompt_tokens: int, include_usage: bool, n: int = 1,
                              echo: str | None = None,
                              request_body: dict[str, Any] | None = None,
                              tool_parser: str | None = None,
                              reasoning: Reasoning | None = None) -> AsyncIterator[str]:
    """OpenAI's streaming format: chunks, the usage chunk if asked, then [DONE].

    Each chunk holds one choice, by its `index` (n > 1 interleaves them, as OpenAI does);
    each choice gets its own finish chunk, and a choice the job's end left unfinished (an
    aborted request) gets the job's. `echo` (completions): the prompt's text, sent ahead of
    each choice's first text, as vLLM streams an echo. With the request's tools
    (`request_body`), each choice's text goes through its rein.openai.tools.ToolStream: tool_calls
    deltas. With a reasoning parser (`reasoning`), each choice's thinking comes first as
    `reasoning_content` deltas (rein.openai.reasoning.ReasoningStream); only what follows it
    reaches the content and the tools. Chat usage carries completion_tokens_details.reasoning_tokens."""
    chat = endpoint == "/v1/chat/completions"
    created = int(time.time())
    chunk_id = ("chatcmpl-" if chat else "cmpl-") + job_id
    base = {"id": chunk_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model}

    def chunk(text: str | None, finish_reason: str | None, first: bool = False, index: int = 0,
              tool_delta: dict[str, Any] | None = None) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            if tool_delta:
                delta.update(tool_delta)
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"text": text or "", "index": index, "logprobs": None, "finish_reason": finish_reason}
        body = {**base, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        return sse(json.dumps(body, ensure_ascii=False, separators=(",", ":")))

    if chat:
        for index in range(n):
            yield chunk(None, None, first=True, index=index)
    tool_streams = {i: stream_for(request_body, chunk_id, i, tool_parser) for i in range(n)} if chat else {}
    thinking = {i: ReasoningStream(reasoning) for i in range(n)} if chat and reasoning is not None else {}

    def content(index: int, text: str | None) -> list[str]:
        """The chunks of content `text` (after any thinking): through the choice's tools, if any."""
        tool_stream = tool_streams.get(index)
        if tool_stream is None:
            return [chunk(text, None, index=index)] if text else []
        return [chunk(None, None, index=index, tool_delta=d) for d in tool_stream.feed(text or "")]

    def split(index: int, deltas: list[dict[str, str]]) -> list[str]:
        lines = []
        for delta in deltas:
            if "reasoning_content" in delta:   # also as `reasoning`, newer vLLM's name
                lines.append(chunk(None, None, index=index, tool_delta={**delta, "reasoning": delta["reasoning_content"]}))
            else:
                lines.extend(content(index, delta["content"]))
        return lines

    def feed(index: int, text: str | None, token_ids: list[int]) -> list[str]:
        stream = thinking.get(index)
        if stream is None:
            return content(index, text)
        return split(index, stream.feed(text or "", token_ids))

    def end_choice(index: int, text: str | None, reason: str | None, token_ids: list[int]) -> list[str]:
        tool_stream = tool_streams.get(index)
        if tool_stream is None and index not in thinking:
            return [chunk(text, reason, index=index)]
        lines = feed(index, text, token_ids)
        if index in thinking:
            lines.extend(split(index, thinking[index].finish()))
        if tool_stream is None:
            return [*lines, chunk(None, reason, index=index)]
        tool_deltas, reason = tool_stream.finish(reason)
        return [*lines, *(chunk(None, None, index=index, tool_delta=d) for d in tool_deltas),
                chunk(None, reason, index=index)]

    usage: dict[str, Any] | None = None
    echoed: set[int] = set()
    ended: set[int] = set()
    async for event in events:
        if event is None:
            yield KEEPALIVE
            continue
        data = event.data
        if data.get("error"):
            error = {"error": {"message": data["error"], "type": "server_error", "param": None,
                               "code": data.get("code") or "job_failed"}}
            yield sse(json.dumps(error))
            break
        index = data.get("index", 0)
        finish = data.get("finish_reason")
        choice_finish = data.get("choice_finish_reason") or finish
        text = data.get("text")
        if echo is not None and index not in echoed:
            echoed.add(index)
            text = echo + (text or "")
        token_ids = list(data.get("token_ids") or ())
        if choice_finish:
            ended.add(index)
            for line in end_choice(index, text, _FINISH_REASONS.get(choice_finish, choice_finish), token_ids):
                yield line
        else:
            for line in feed(index, text, token_ids):
                yield line
        if finish:
            usage = data.get("usage")
            for other in range(n):   # choices the job's end stopped (an abort) end with it
                if other not in ended:
                    text = echo if echo is not None and other not in echoed else None
                    for line in end_choice(other, text, _FINISH_REASONS.get(finish, finish), []):
                        yield line
    if include_usage:
        usage = dict(usage or usage_body(prompt_tokens, 0))
        if chat and reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(s.reasoning_tokens for s in thinking.values())}
        yield sse(json.dumps({**base, "choices": [], "usage": usage}, separators=(",", ":")))
    yield sse("[DONE]")
