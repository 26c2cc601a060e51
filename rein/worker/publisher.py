"""Token events to Redis: per engine step, every running job's delta in one round trip.

`TokenPublisher.publish_step` is the engine runner's `on_step` hook: it turns the step's
outputs into `TokenEvent`s (seq counts from 1 per job, with no gaps) and sends them all
with one EVALSHA of a server-side script (`_PUBLISH_LUA`), which does for each event an
XADD to the job's stream with the explicit id `<seq>-0` and MAXLEN ~ stream_maxlen, and a
PUBLISH of the same JSON on the job's channel. The first event gives the stream an expiry
past the longest job (so a job whose worker dies does not leave it forever); the final
event shortens it to stream_ttl_seconds after the job ended.

Why a script rather than a client pipeline of XADD + PUBLISH per event: the worker packs,
sends and parses one command per step instead of two or three per job per step. Measured
on the tiny model (64 jobs a step): the pipeline cost the engine thread ~12 µs of CPU per
event, holding the GIL, and its round trip doubled the wall time of an engine-bound batch;
the script ~2 µs.

Batch lines (`begin(..., coalesce=True)`, the worker's rein.worker.tasks) rarely have a
live follower, so their deltas are coalesced: a choice's tokens are held until
`batch_event_seconds` have passed since the first held one (or the choice or job ends),
then go out as one event. Events keep their shape (text, token ids, seq without gaps);
there are just fewer of them, each covering several steps. Interactive jobs get an event
every step, as before.

With `background=True` (the worker) the engine thread only numbers the events and queues
them; a sender thread makes the round trips, in order. The engine's next step then does
not wait for Redis, and when Redis is slower than the engine the sender takes every step
queued meanwhile in one call. `flush()` waits until what was queued so far is sent (or
kept to retry): the worker calls it before recording a job, so a job's final event is in
Redis before its result is in Postgres, as when the engine thread sent it itself.

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

import hashlib
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rein.engine.step_outputs import RequestOutput
from rein.openai.response import usage_body
from rein.store.messages import STREAM_FIELD, TokenEvent
from rein.store.redis_keys import RedisKeys
from rein.worker.recorder import storable_text

log = logging.getLogger(__name__)

RETRY_SECONDS = 1.0
MAX_BACKLOG = 100_000
# A batch job's deltas are held at most this long before they go out as one event.
BATCH_EVENT_SECONDS = 1.0
# Events per EVALSHA: a script blocks Redis while it runs, so a long backlog goes in pieces.
MAX_EVENTS_PER_CALL = 1024

# The events of one step. KEYS: the streams to drop first (an earlier attempt's, see
# `begin`), then a (stream, channel) pair per event. ARGV: maxlen, the open and the final
# stream TTL, the stream field, how many KEYS are streams to drop, then (seq, final, json)
# per event. Returns the errors other than "equal or smaller" (a retried XADD that had
# landed already), which the worker logs.
_PUBLISH_LUA = b"""
local maxlen, open_ttl, ttl, field = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local stale = tonumber(ARGV[5])
for i = 1, stale do
  redis.call('DEL', KEYS[i])
end
local errors = {}
local arg = 6
for i = stale + 1, #KEYS, 2 do
  local stream, seq, final, data = KEYS[i], ARGV[arg], ARGV[arg + 1], ARGV[arg + 2]
  arg = arg + 3
  local added
  if seq == '1' then
    added = redis.pcall('XADD', stream, 'MAXLEN', '~', maxlen, seq .. '-0', field, data)
  else
    -- NOMKSTREAM past the first event: see the module docstring.
    added = redis.pcall('XADD', stream, 'NOMKSTREAM', 'MAXLEN', '~', maxlen, seq .. '-0', field, data)
  end
  if type(added) == 'table' and added.err and not string.find(added.err, 'equal or smaller', 1, true) then
    errors[#errors + 1] = added.err
  end
  redis.call('PUBLISH', KEYS[i + 1], data)
  if final == '1' then
    redis.call('EXPIRE', stream, ttl)
  elseif seq == '1' then
    redis.call('EXPIRE', stream, open_ttl)
  end
end
return errors
"""
_PUBLISH_SHA = hashlib.sha1(_PUBLISH_LUA).hexdigest()

INTERRUPTED = "interrupted"
TIMEOUT = "timeout"


@dataclass
class _Held:
    """A coalesced choice's deltas not yet sent."""

    since: float
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _JobState:
    seq: int = 0
    abort_reason: str | None = None
    # n > 1: each choice's output tokens so far, for the usage the final event sums.
    choice_tokens: dict[int, int] = field(default_factory=dict)
    coalesce: bool = False
    held: dict[int, _Held] = field(default_factory=dict)   # choice index -> deltas held back


class TokenPublisher:
    def __init__(self, redis: Redis, keys: RedisKeys, stream_maxlen: int, stream_ttl_seconds: int,
                 job_timeout_seconds: int, batch_event_seconds: float = BATCH_EVENT_SECONDS,
                 background: bool = False) -> None:
        self.redis = redis
        self.batch_event_seconds = batch_event_seconds
        self.keys = keys
        self.stream_maxlen = stream_maxlen
        self.stream_ttl_seconds = stream_ttl_seconds
        self.open_stream_ttl_seconds = job_timeout_seconds + stream_ttl_seconds
        # Seq numbering and queueing (or, without a sender thread, sending) stay in order together.
        self._lock = threading.RLock()
        # Two conditions on the lock: the engine thread wakes only the sender (`_queued`), and
        # the sender wakes the tasks waiting in flush() (`_sent`) once per call, not per step.
        self._queued = threading.Condition(self._lock)
        self._sent = threading.Condition(self._lock)
        self._pending: list[tuple[str, TokenEvent]] = []   # queued for the sender thread
        self._tickets = 0    # batches of events queued so far
        self._handled = 0    # of which sent or kept in the backlog
        self._sender: threading.Thread | None = None
        self._stopping = False
        self._jobs: dict[str, _JobState] = {}
        self._backlog: list[tuple[str, TokenEvent]] = []
        self._stale_streams: set[str] = set()   # jobs whose previous attempt's stream must go first
        self._retry_at = 0.0
        self._closed = False
        self.pipelines_sent = 0   # script calls made (the name is older than the script)
        if background:
            self._sender = threading.Thread(target=self._send_loop, name="rein-token-sender", daemon=True)
            self._sender.start()

    # -- job lifecycle (task threads) --------------------------------------------------------

    def begin(self, job_id: str, restart: bool = False, coalesce: bool = False) -> None:
        """Start numbering a job's events; `restart` (a new attempt) first drops its old stream;
        `coalesce` (a batch job) sends its deltas every `batch_event_seconds`, not every step."""
        with self._lock:
            self._jobs[job_id] = _JobState(coalesce=coalesce)
        if restart:
            self.flush()   # nothing of the previous attempt may land after the drop
            try:
                self.redis.delete(self.keys.job_stream(job_id))
            except (RedisConnectionError, RedisTimeoutError) as exc:
                # Redis is away: drop the old stream ahead of the new attempt's first events,
                # in the script call that sends them (_send).
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
            self._submit([(job_id, event)])
        return event

    def close(self) -> None:
        """From now on every abort counts as an interruption (the worker is shutting down)."""
        with self._lock:
            self._closed = True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every event queued so far is sent (or kept in the backlog to retry);
        False after `timeout`. Immediate without a sender thread."""
        with self._lock:
            ticket = self._tickets
            return self._sent.wait_for(lambda: self._handled >= ticket or self._sender is None, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Send what is queued and end the sender thread."""
        sender = self._sender
        if sender is None:
            return
        with self._lock:
            self._stopping = True
            self._queued.notify()
        if sender is not threading.current_thread():
            sender.join(timeout)

    # -- the engine thread -------------------------------------------------------------------

    def publish_step(self, outputs: Iterable[RequestOutput]) -> None:
        """The runner's on_step hook: one round trip for all of this step's events."""
        now = time.monotonic()
        with self._lock:
            events: list[tuple[str, TokenEvent]] = []
            for output in outputs:
                state = self._jobs.get(output.request_id)
                if state is not None:            # else not a job this publisher streams
                    self._events(output, state, now, events)
            self._submit(events)

    def _events(self, output: RequestOutput, state: _JobState, now: float,
                events: list[tuple[str, TokenEvent]]) -> None:
        """Append the events `output` makes (none while a batch job's deltas are held)."""
        job_id = output.request_id
        state.choice_tokens[output.index] = output.num_output_tokens
        text, token_ids = storable_text(output.text_delta), list(output.new_token_ids)
        if not output.finished:
            # One choice of several ended (n > 1). Not for an abort: the job's final event says
            # why it stopped, and an interrupted attempt must publish nothing.
            choice_end = output.finish_reason if output.finish_reason != "abort" else None
            if not token_ids and not text and choice_end is None:
                return
            if state.coalesce:
                held = state.held.get(output.index)
                if held is None:
                    held = state.held[output.index] = _Held(now)
                held.text.append(text)
                held.token_ids += token_ids
                if choice_end is None and now - held.since < self.batch_event_seconds:
                    return
                del state.held[output.index]
                text, token_ids = "".join(held.text), held.token_ids
            state.seq += 1
            events.append((job_id, TokenEvent(seq=state.seq, text=text, token_ids=token_ids, index=output.index,
                                              choice_finish_reason=choice_end)))
            return
        del self._jobs[job_id]
        several = len(state.choice_tokens) > 1 or output.index > 0
        completion = sum(state.choice_tokens.values()) if several else output.num_output_tokens
        usage = usage_body(output.num_prompt_tokens, completion, output.num_cached_tokens)
        error = output.error
        if output.finish_reason == "abort" and error is None:
            reason = state.abort_reason or (INTERRUPTED if self._closed else None)
            if reason == INTERRUPTED:
                return                           # the next attempt restarts the stream
            if reason == TIMEOUT:
                error = "the job ran past its time limit and was stopped"
        if state.held:
            # What other choices still hold goes out before the end (an abort ends them all).
            mine = state.held.pop(output.index, None)
            for index, held in sorted(state.held.items()):
                state.seq += 1
                events.append((job_id, TokenEvent(seq=state.seq, text="".join(held.text),
                                                  token_ids=held.token_ids, index=index)))
            if mine is not None:
                text, token_ids = "".join(mine.text) + text, mine.token_ids + token_ids
        state.seq += 1
        events.append((job_id, TokenEvent(seq=state.seq, text=text, token_ids=token_ids,
                                          finish_reason=output.finish_reason, usage=usage, error=error,
                                          index=output.index,
                                          choice_finish_reason=output.finish_reason if several else None)))

    # -- Redis -------------------------------------------------------------------------------

    def _submit(self, events: list[tuple[str, TokenEvent]]) -> None:
        """Queue events for the sender thread, or send them now without one (caller holds the lock)."""
        if not events:
            return
        if self._sender is None or self._stopping and not self._sender.is_alive():
            self._send(events)
            return
        self._pending += events
        self._tickets += 1
        self._queued.notify()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                self._queued.wait_for(lambda: self._pending or self._stopping
                                      or (self._backlog and time.monotonic() >= self._retry_at), RETRY_SECONDS)
                if self._stopping and not self._pending:
                    self._handled = self._tickets
                    self._sent.notify_all()
                    return
                events, self._pending, ticket = self._pending, [], self._tickets
            try:
                self._send(events)
            except Exception:   # never lose the thread; the events are dropped, followers use Postgres
                log.exception("token sender failed on %d events", len(events))
            with self._lock:
                self._handled = ticket
                self._sent.notify_all()

    def _send(self, events: list[tuple[str, TokenEvent]]) -> None:
        """One round trip for the backlog and these events; a long backlog in pieces of
        MAX_EVENTS_PER_CALL. Called by one thread at a time: the sender thread, or without one
        the caller holding the lock."""
        batch = self._backlog + events if self._backlog else events
        if not batch:
            return
        if time.monotonic() < self._retry_at:
            self._keep(batch)
            return
        keys = self.keys
        for start in range(0, len(batch), MAX_EVENTS_PER_CALL):
            part = batch[start:start + MAX_EVENTS_PER_CALL]
            with self._lock:
                stale = sorted({job_id for job_id, _ in part} & self._stale_streams)
            names = [keys.job_stream(job_id) for job_id in stale]
            args: list[Any] = [self.stream_maxlen, self.open_stream_ttl_seconds, self.stream_ttl_seconds,
                               STREAM_FIELD, len(stale)]
            for job_id, event in part:
                names += (keys.job_stream(job_id), keys.job_channel(job_id))
                args += (event.seq, 1 if event.final else 0, event.to_json())
            try:
                errors = self._call(names, args)
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                self._keep(batch[start:])
                self._retry_at = time.monotonic() + RETRY_SECONDS
                log.warning("cannot publish %d token events (kept to retry): %s", len(batch) - start, exc)
                return
            with self._lock:
                self._stale_streams.difference_update(stale)
            self.pipelines_sent += 1
            for error in errors or ():
                log.warning("token event refused by Redis: %s", error.decode() if isinstance(error, bytes) else error)
        self._backlog = []
        self._retry_at = 0.0

    def _call(self, keys: list[str], args: list[Any]) -> Any:
        """EVALSHA of the publish script, loading it first if this Redis does not have it."""
        try:
            return self.redis.evalsha(_PUBLISH_SHA, len(keys), *keys, *args)
        except NoScriptError:
            self.redis.script_load(_PUBLISH_LUA)
            return self.redis.evalsha(_PUBLISH_SHA, len(keys), *keys, *args)

    def _keep(self, batch: list[tuple[str, TokenEvent]]) -> None:
        if len(batch) > MAX_BACKLOG:
            log.error("token event backlog over %d: dropping the oldest %d events", MAX_BACKLOG,
                      len(batch) - MAX_BACKLOG)
            batch = batch[-MAX_BACKLOG:]
        self._backlog = batch
