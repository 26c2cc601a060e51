"""Token events to Redis: per engine step, every running job's delta in one pipeline.

`TokenPublisher.publish_step` is the engine runner's `on_step` hook: it turns the step's
outputs into `TokenEvent`s (seq counts from 1 per job, with no gaps) and sends them all
in one non-transactional pipeline — for each event an XADD to the job's stream with the
explicit id `<seq>-0` and MAXLEN ~ stream_maxlen, and a PUBLISH of the same JSON on the
job's channel. The first event gives the stream an expiry past the longest job (so a
job whose worker dies does not leave it forever); the final event shortens it to
stream_ttl_seconds after the job ended.

Only a job's first event creates its stream (later XADDs use NOMKSTREAM): a stream lost
with a Redis that restarted empty is not recreated from the middle, which followers would
read as a gap; the job's next attempt starts it anew, or followers get the result from
Postgres.

If Redis cannot be reached the events wait in a bounded backlog and go out, in order,
with a later step (an XADD that already landed is refused by Redis as "equal or smaller"
and ignored), so a blip costs latency, not gaps. The engine thread is never blocked
longer than one attempt per RETRY_SECONDS.

A request with n > 1 choices: every event carries its choice's `index`; the event that
ends one choice has `choice_finish_reason`, and the job's final event (the last choice to
end) has both that and `finish_reason`, with `usage` summing every choice's tokens.

How an aborted request's final event reads depends on why it was aborted (see
`mark_abort`): a cancel ends the stream with finish_reason "abort"; a timeout with an
error; an interrupted attempt (shutdown, broker connection lost) publishes nothing, as the
job will run again and its next attempt restarts the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rein.core.messages import STREAM_FIELD, TokenEvent, event_id
from rein.core.redis_keys import RedisKeys
from rein.engine.outputs import RequestOutput
from rein.openai_format import usage_body
from rein.worker.recorder import storable_text

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
MAX_BACKLOG = 100_000

INTERRUPTED = "interrupted"
TIMEOUT = "timeout"


@dataclass
class _JobState:
    seq: int = 0
    abort_reason: str | None = None
    # n > 1: each choice's output tokens so far, for the usage the final event sums.
    choice_tokens: dict[int, int] = field(default_factory=dict)


class TokenPublisher:
    def __init__(self, redis: Redis, keys: RedisKeys, stream_maxlen: int, stream_ttl_seconds: int,
                 job_timeout_seconds: int) -> None:
        self.redis = redis
        self.keys = keys
        self.stream_maxlen = stream_maxlen
        self.stream_ttl_seconds = stream_ttl_seconds
        self.open_stream_ttl_seconds = job_timeout_seconds + stream_ttl_seconds
        self._lock = threading.Lock()   # seq numbering and sending stay in order together
        self._jobs: dict[str, _JobState] = {}
        self._backlog: list[tuple[str, TokenEvent]] = []
        self._stale_streams: set[str] = set()   # jobs whose previous attempt's stream must go first
        self._retry_at = 0.0
        self._closed = False
        self.pipelines_sent = 0

    # -- job lifecycle (task threads) --------------------------------------------------------

    def begin(self, job_id: str, restart: bool = False) -> None:
        """Start numbering a job's events; `restart` (a new attempt) first drops its old stream."""
        with self._lock:
            self._jobs[job_id] = _JobState()
        if restart:
            try:
                self.redis.delete(self.keys.job_stream(job_id))
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # Redis is away: drop the old stream ahead of the new attempt's first events,
                # in the pipeline that sends them (_send).
                log.warning("could not drop the old stream of job %s yet: %s", job_id, exc)
                with self._lock:
                    self._stale_streams.add(job_id)

    def mark_abort(self, job_id: str, reason: str) -> None:
        """Say why the job is about to be aborted: INTERRUPTED or TIMEOUT (default: a cancel)."""
        with self._lock:
            state = self._jobs.get(job_id)
            if state is not None:
                state.abort_reason = reason

    def forget(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
            self._stale_streams.discard(job_id)

    def publish_final(self, job_id: str, *, finish_reason: str | None = None,
                      usage: dict[str, Any] | None = None, error: str | None = None) -> TokenEvent:
        """End a job's stream from outside the engine (failed, or cancelled before it ran)."""
        if finish_reason is None and error is None:
            raise ValueError("a final event needs a finish_reason or an error")
        with self._lock:
            state = self._jobs.pop(job_id, None) or _JobState()
            state.seq += 1
            event = TokenEvent(seq=state.seq, text="", finish_reason=finish_reason, usage=usage, error=error)
            self._send([(job_id, event)])
        return event

    def close(self) -> None:
        """From now on every abort counts as an interruption (the worker is shutting down)."""
        with self._lock:
            self._closed = True

    # -- the engine thread -------------------------------------------------------------------

    def publish_step(self, outputs: Iterable[RequestOutput]) -> None:
        """The runner's on_step hook: one pipeline for all of this step's events."""
        with self._lock:
            events = []
            for output in outputs:
                event = self._event(output)
                if event is not None:
                    events.append((output.request_id, event))
            self._send(events)

    def _event(self, output: RequestOutput) -> TokenEvent | None:
        state = self._jobs.get(output.request_id)
        if state is None:
            return None                      # not a job this publisher streams
        state.choice_tokens[output.index] = output.num_output_tokens
        if not output.finished:
            # One choice of several ended (n > 1). Not for an abort: the job's final event says
            # why it stopped, and an interrupted attempt must publish nothing.
            choice_end = output.finish_reason if output.finish_reason != "abort" else None
            if not output.new_token_ids and not output.text_delta and choice_end is None:
                return None
            state.seq += 1
            return TokenEvent(seq=state.seq, text=storable_text(output.text_delta),
                              token_ids=list(output.new_token_ids), index=output.index,
                              choice_finish_reason=choice_end)
        del self._jobs[output.request_id]
        several = len(state.choice_tokens) > 1 or output.index > 0
        completion = sum(state.choice_tokens.values()) if several else output.num_output_tokens
        usage = usage_body(output.num_prompt_tokens, completion, output.num_cached_tokens)
        error = None
        if output.finish_reason == "abort":
            reason = state.abort_reason or (INTERRUPTED if self._closed else None)
            if reason == INTERRUPTED:
                return None
            if reason == TIMEOUT:
                error = "the job ran past its time limit and was stopped"
        state.seq += 1
        return TokenEvent(seq=state.seq, text=storable_text(output.text_delta),
                          token_ids=list(output.new_token_ids), finish_reason=output.finish_reason,
                          usage=usage, error=error, index=output.index,
                          choice_finish_reason=output.finish_reason if several else None)

    # -- Redis -------------------------------------------------------------------------------

    def _send(self, events: list[tuple[str, TokenEvent]]) -> None:
        """One round trip for the backlog and these events (caller holds the lock)."""
        batch = self._backlog + events if self._backlog else events
        if not batch:
            return
        if time.monotonic() < self._retry_at:
            self._keep(batch)
            return
        pipe = self.redis.pipeline(transaction=False)
        stale = {job_id for job_id, _ in batch} & self._stale_streams
        for job_id in stale:
            pipe.delete(self.keys.job_stream(job_id))
        for job_id, event in batch:
            stream = self.keys.job_stream(job_id)
            data = event.to_json()
            # NOMKSTREAM past the first event: a stream that is gone (lost with a Redis that
            # restarted empty) is not recreated from the middle, which a follower would read
            # as a gap; the job's result then comes from Postgres (rein.api.streams).
            pipe.xadd(stream, {STREAM_FIELD: data}, id=event_id(event.seq), maxlen=self.stream_maxlen,
                      approximate=True, nomkstream=event.seq > 1)
            pipe.publish(self.keys.job_channel(job_id), data)
            if event.final:
                pipe.expire(stream, self.stream_ttl_seconds)
            elif event.seq == 1:
                pipe.expire(stream, self.open_stream_ttl_seconds)
        try:
            results = pipe.execute(raise_on_error=False)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            self._keep(batch)
            self._retry_at = time.monotonic() + RETRY_SECONDS
            log.warning("cannot publish %d token events (kept to retry): %s", len(batch), exc)
            return
        self._backlog = []
        self._stale_streams -= stale
        self._retry_at = 0.0
        self.pipelines_sent += 1
        for result in results:
            # A retried XADD that had landed before the connection dropped: already there.
            if isinstance(result, ResponseError) and "equal or smaller" not in str(result):
                log.warning("token event refused by Redis: %s", result)

    def _keep(self, batch: list[tuple[str, TokenEvent]]) -> None:
        if len(batch) > MAX_BACKLOG:
            log.error("token event backlog over %d: dropping the oldest %d events", MAX_BACKLOG,
                      len(batch) - MAX_BACKLOG)
            batch = batch[-MAX_BACKLOG:]
        self._backlog = batch
