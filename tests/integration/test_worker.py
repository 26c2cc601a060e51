"""The worker against real Redis and Postgres: the token publisher, the lease, the
recorder, cancellation, queue priority, and a Celery worker running in this process
(threads pool, tiny model) taking jobs end to end."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import support
from sqlalchemy import func, select, update

from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.jobs.cancel import is_cancel_requested, request_cancel
from rein.jobs.claim import ClaimOutcome, cancel_unstarted_job, claim_job, release_job
from rein.jobs.queues import enqueue_job, queue_keys, worker_queues
from rein.jobs.results import response_body
from rein.openai.response import usage_body
from rein.store.messages import (
    STREAM_FIELD,
    JobMessage,
    TokenEvent,
)
from rein.store.redis_keys import RedisKeys
from rein.store.tables import Job, Result, Usage
from rein.worker.app import make_worker_celery
from rein.worker.cancel import CancelListener
from rein.worker.publisher import TokenPublisher
from rein.worker.recorder import JobRecord, record_job

MODEL = "tiny"
WAIT = 60.0   # generous: the CI machine may be busy


def wait_for(predicate: Callable[[], object], timeout: float = WAIT, what: str = "condition") -> object:
    return support.wait_for(predicate, timeout, what)


@pytest.fixture(scope="module")
def keys(settings) -> RedisKeys:
    return RedisKeys.from_settings(settings)


def job_row(sessions, job_id: str) -> Job:
    with sessions() as session:
        return session.get(Job, job_id)


def usage_rows(sessions, job_id: str) -> list[Usage]:
    with sessions() as session:
        return list(session.scalars(select(Usage).where(Usage.job_id == job_id)))


def stream_events(redis, keys, job_id: str) -> list[tuple[str, TokenEvent]]:
    return [(entry_id.decode(), TokenEvent.from_json(fields[STREAM_FIELD.encode()]))
            for entry_id, fields in redis.xrange(keys.job_stream(job_id))]


# -- the publisher -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models):
    from rein.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                                  max_num_seqs=4))


def test_publisher_sends_one_pipeline_per_step_with_gapless_ids(engine, redis_client, keys, settings):
    from rein.engine import EngineClient, SamplingParams

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=120,
                               job_timeout_seconds=600)
    steps: list[int] = []

    def on_step(outputs):
        publisher.publish_step(outputs)
        steps.append(len(outputs))

    jobs = [f"job_pub_{secrets.token_hex(4)}_{i}" for i in range(3)]
    live = redis_client.pubsub(ignore_subscribe_messages=True)
    live.subscribe(keys.job_channel(jobs[0]))
    texts: dict[str, str] = {}
    with EngineClient(engine, on_step=on_step) as runner:
        streams = []
        for i, job_id in enumerate(jobs):
            publisher.begin(job_id)
            streams.append(runner.submit(job_id, [9, 10 + i, 11], SamplingParams(max_tokens=5 + i, temperature=0,
                                                                                  ignore_eos=True)))
        for job_id, stream in zip(jobs, streams, strict=True):
            texts[job_id] = "".join(o.text_delta for o in stream)
    publisher.begin("not-streamed-after-all")
    publisher.forget("not-streamed-after-all")

    assert publisher.pipelines_sent == len(steps)          # exactly one round trip per step
    assert max(steps) > 1                                  # and steps did carry several jobs
    for i, job_id in enumerate(jobs):
        events = stream_events(redis_client, keys, job_id)
        assert [entry_id for entry_id, _ in events] == [f"{n}-0" for n in range(1, len(events) + 1)]
        assert [e.seq for _, e in events] == list(range(1, len(events) + 1))
        assert "".join(e.text for _, e in events) == texts[job_id]
        final = events[-1][1]
        assert final.finish_reason == "length" and all(not e.final for _, e in events[:-1])
        assert final.usage == usage_body(3, 5 + i)
        assert sum(len(e.token_ids) for _, e in events) == 5 + i
        assert 0 < redis_client.ttl(keys.job_stream(job_id)) <= 120     # expires after the job
    expected = [e for _, e in stream_events(redis_client, keys, jobs[0])]
    received: list[TokenEvent] = []
    deadline = time.monotonic() + 10
    while len(received) < len(expected) and time.monotonic() < deadline:
        message = live.get_message(timeout=0.5)   # None also for the ignored subscribe reply
        if message is not None:
            received.append(TokenEvent.from_json(message["data"]))
    live.close()
    assert received == expected


def test_open_stream_expires_past_the_longest_job(redis_client, keys):
    from rein.engine.step_outputs import RequestOutput

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=60,
                               job_timeout_seconds=600)
    job_id = f"job_open_{secrets.token_hex(4)}"
    publisher.begin(job_id)
    publisher.publish_step([RequestOutput(job_id, [4], "a")])
    assert 600 < redis_client.ttl(keys.job_stream(job_id)) <= 660
    publisher.publish_final(job_id, error="boom")
    events = stream_events(redis_client, keys, job_id)
    assert [e.seq for _, e in events] == [1, 2] and events[-1][1].error == "boom"
    assert redis_client.ttl(keys.job_stream(job_id)) <= 60


def test_publisher_keeps_events_while_redis_is_away_and_sends_them_in_order(redis_client, redis_url, keys):
    from redis import Redis

    from rein.engine.step_outputs import RequestOutput
    from rein.worker import publisher as publisher_module

    broken = Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)   # nothing listens there
    publisher = TokenPublisher(broken, keys, stream_maxlen=1000, stream_ttl_seconds=60, job_timeout_seconds=60)
    job_id = f"job_blip_{secrets.token_hex(4)}"
    publisher.begin(job_id)
    publisher.publish_step([RequestOutput(job_id, [4], "a")])
    publisher.publish_step([RequestOutput(job_id, [5], "b")])
    assert publisher.pipelines_sent == 0
    publisher.redis = redis_client                          # Redis is back
    publisher._retry_at = 0.0
    publisher.publish_step([RequestOutput(job_id, [6], "c", finished=True, finish_reason="stop",
                                          num_prompt_tokens=2, num_output_tokens=3)])
    events = stream_events(redis_client, keys, job_id)
    assert "".join(e.text for _, e in events) == "abc" and [e.seq for _, e in events] == [1, 2, 3]
    assert publisher_module.MAX_BACKLOG > 0


def test_a_lost_stream_is_not_recreated_from_the_middle(redis_client, keys):
    """Redis lost the job's stream (restarted empty): later events do not start a new stream
    at seq 3, which followers would read as a gap; a new attempt's first event does."""
    from rein.engine.step_outputs import RequestOutput

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=60, job_timeout_seconds=60)
    job_id = f"job_lost_{secrets.token_hex(4)}"
    publisher.begin(job_id)
    publisher.publish_step([RequestOutput(job_id, [4], "a")])
    publisher.publish_step([RequestOutput(job_id, [5], "b")])
    redis_client.delete(keys.job_stream(job_id))            # what a restart without data does
    publisher.publish_step([RequestOutput(job_id, [6], "c")])
    assert not redis_client.exists(keys.job_stream(job_id))
    publisher.forget(job_id)
    publisher.begin(job_id, restart=True)                    # the job's next attempt
    publisher.publish_step([RequestOutput(job_id, [4], "a")])
    assert [e.seq for _, e in stream_events(redis_client, keys, job_id)] == [1]


def test_a_batch_jobs_deltas_are_coalesced_into_fewer_events(redis_client, keys):
    """coalesce=True holds a choice's deltas until batch_event_seconds have passed (or it ends):
    fewer events, the same text and token ids, seq without gaps."""
    from rein.engine.step_outputs import RequestOutput

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=60,
                               job_timeout_seconds=60, batch_event_seconds=3600)
    job_id = f"job_coalesce_{secrets.token_hex(4)}"
    publisher.begin(job_id, coalesce=True)
    for token, text in ((4, "a"), (5, "b")):
        publisher.publish_step([RequestOutput(job_id, [token], text)])
    assert not redis_client.exists(keys.job_stream(job_id))      # held back
    publisher.batch_event_seconds = 0.0                           # their time has come
    publisher.publish_step([RequestOutput(job_id, [6], "c")])
    publisher.batch_event_seconds = 3600
    publisher.publish_step([RequestOutput(job_id, [7], "d")])
    publisher.publish_step([RequestOutput(job_id, [8], "e", finished=True, finish_reason="length",
                                          num_prompt_tokens=2, num_output_tokens=5)])
    events = [e for _, e in stream_events(redis_client, keys, job_id)]
    assert [(e.seq, e.text, e.token_ids, e.final) for e in events] == [(1, "abc", [4, 5, 6], False),
                                                                       (2, "de", [7, 8], True)]
    assert events[-1].usage == usage_body(2, 5) and 0 < redis_client.ttl(keys.job_stream(job_id)) <= 60
    # An interactive job's deltas still go out every step.
    other = f"job_steps_{secrets.token_hex(4)}"
    publisher.begin(other)
    publisher.publish_step([RequestOutput(other, [4], "a")])
    publisher.publish_step([RequestOutput(other, [5], "b", finished=True, finish_reason="stop")])
    assert [e.text for _, e in stream_events(redis_client, keys, other)] == ["a", "b"]


def test_a_coalesced_jobs_held_choices_go_out_before_its_end(redis_client, keys):
    """n > 1: a choice's end sends what it held; a cancel (abort) sends every choice's held
    deltas before the final event, so each choice's text is complete."""
    from rein.engine.step_outputs import RequestOutput

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=60,
                               job_timeout_seconds=60, batch_event_seconds=3600)
    job_id = f"job_coalesce_n_{secrets.token_hex(4)}"
    publisher.begin(job_id, coalesce=True)
    publisher.publish_step([RequestOutput(job_id, [1], "a", index=0, num_output_tokens=1),
                            RequestOutput(job_id, [2], "x", index=1, num_output_tokens=1),
                            RequestOutput(job_id, [3], "y", index=2, num_output_tokens=1)])
    publisher.publish_step([RequestOutput(job_id, [4], "z", index=2, finish_reason="stop", num_output_tokens=2)])
    publisher.publish_step([RequestOutput(job_id, [5], "b", index=0, finished=True, finish_reason="abort",
                                          num_prompt_tokens=3, num_output_tokens=2)])
    events = [e for _, e in stream_events(redis_client, keys, job_id)]
    assert [(e.seq, e.index, e.text, e.choice_finish_reason) for e in events] == [
        (1, 2, "yz", "stop"), (2, 1, "x", None), (3, 0, "ab", "abort")]
    assert events[-1].finish_reason == "abort" and events[-1].usage["completion_tokens"] == 5


def test_the_sender_thread_sends_in_order_and_flush_waits_for_it(redis_client, keys):
    """background=True: events are queued by the engine thread and sent by the sender thread;
    flush() returns once everything queued so far is in Redis; after stop() the publisher
    sends on the caller's thread."""
    from rein.engine.step_outputs import RequestOutput

    publisher = TokenPublisher(redis_client, keys, stream_maxlen=1000, stream_ttl_seconds=60,
                               job_timeout_seconds=60, background=True)
    jobs = [f"job_bg_{secrets.token_hex(4)}_{i}" for i in range(3)]
    for job_id in jobs:
        publisher.begin(job_id)
    for step in range(20):
        publisher.publish_step([RequestOutput(job_id, [step], f"{step},") for job_id in jobs])
    assert publisher.flush(timeout=30)
    for job_id in jobs:
        events = [e for _, e in stream_events(redis_client, keys, job_id)]
        assert [e.seq for e in events] == list(range(1, 21))
        assert "".join(e.text for e in events) == "".join(f"{step}," for step in range(20))
    assert publisher.pipelines_sent <= 20        # several steps in one call when the sender lags
    publisher.stop()
    assert not publisher._sender.is_alive()
    publisher.publish_final(jobs[0], error="boom")
    assert stream_events(redis_client, keys, jobs[0])[-1][1].error == "boom"


# -- the lease and the recorder ------------------------------------------------------------------


def test_claim_is_exclusive_and_a_finished_job_is_never_claimed_again(make_job, db_sessionmaker):
    message = make_job()
    first = claim_job(db_sessionmaker, message.job_id, "w1", 600)
    assert first.outcome is ClaimOutcome.CLAIMED and first.lease.attempt == 1
    row = job_row(db_sessionmaker, message.job_id)
    assert row.status == "running" and row.worker == "w1" and row.started_at is not None
    assert row.lease_expires_at is not None

    again = claim_job(db_sessionmaker, message.job_id, "w2", 600)     # a redelivery while it runs
    assert again.outcome is ClaimOutcome.HELD_ELSEWHERE and again.lease is None

    assert record_job(db_sessionmaker, first.lease, JobRecord(status="succeeded", text="hi", token_ids=[1, 2],
                                                              finish_reason="stop", prompt_tokens=4,
                                                              completion_tokens=2))
    late = claim_job(db_sessionmaker, message.job_id, "w2", 600)      # a redelivery after it finished
    assert late.outcome is ClaimOutcome.FINISHED
    assert job_row(db_sessionmaker, message.job_id).attempt == 1
    assert claim_job(db_sessionmaker, "job_missing", "w1", 600).outcome is ClaimOutcome.MISSING


def call_while_the_first_writes(group, call, items, release: threading.Event) -> None:
    """`call(item)` on a thread per item against a GroupCommit (rein.jobs.group_commit) whose
    first writer is held up (until `release`): the other items all wait, then go as a group."""
    threads = [threading.Thread(target=call, args=(item,)) for item in items]
    threads[0].start()
    wait_for(lambda: group._writing, 10, "the first writer")
    for thread in threads[1:]:
        thread.start()
    wait_for(lambda: len(group._waiting) == len(items) - 1, 10, "the other calls to wait")
    release.set()
    for thread in threads:
        thread.join(10)


def test_several_jobs_are_claimed_in_one_statement_each_told_its_outcome(make_job, db_sessionmaker):
    from datetime import timedelta

    from rein.jobs.claim import claim_jobs

    queued, finished, cancelled, held, expired = (make_job().job_id for _ in range(5))
    done = claim_job(db_sessionmaker, finished, "w0", 600).lease
    record_job(db_sessionmaker, done, JobRecord(status="succeeded", text="x", token_ids=[1], finish_reason="stop",
                                               prompt_tokens=4, completion_tokens=1))
    claim_job(db_sessionmaker, held, "w0", 600)
    claim_job(db_sessionmaker, expired, "w0", 600)
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == cancelled).values(cancel_requested_at=func.now()))
        session.execute(update(Job).where(Job.id == expired)
                        .values(lease_expires_at=func.now() - timedelta(seconds=1)))
    ids = [queued, finished, cancelled, "job_missing", held, expired]
    claims = claim_jobs(db_sessionmaker, ids, "w1", 600)
    assert [c.outcome for c in claims] == [ClaimOutcome.CLAIMED, ClaimOutcome.FINISHED, ClaimOutcome.CANCELLED,
                                           ClaimOutcome.MISSING, ClaimOutcome.HELD_ELSEWHERE, ClaimOutcome.CLAIMED]
    assert (claims[0].lease.attempt, claims[5].lease.attempt) == (1, 2)     # the expired lease: a new attempt
    assert claims[0].lease.queue_seconds is not None and claims[0].lease.worker == "w1"
    assert {job_row(db_sessionmaker, i).worker for i in (queued, expired)} == {"w1"}
    assert job_row(db_sessionmaker, held).worker == "w0" and job_row(db_sessionmaker, cancelled).status == "cancelled"


def test_group_claimer_groups_what_waits_and_never_claims_a_job_twice(make_job, db_sessionmaker, monkeypatch):
    """Claims that wait for the writer go as one statement; two messages of one job (a
    duplicate) never share it: one claims, the other finds the job held."""
    import rein.jobs.claim as claim_module
    from rein.jobs.claim import GroupClaimer

    claimer = GroupClaimer(db_sessionmaker, "w1", 600)
    jobs = [make_job().job_id for _ in range(6)]
    requests = jobs + [jobs[1]]                        # the last: a duplicate message of jobs[1]
    real, release = claim_module.claim_job, threading.Event()

    def slow_claim(*args, **kwargs):
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(claim_module, "claim_job", slow_claim)
    outcomes: list[tuple[str, ClaimOutcome]] = []

    def claim(job_id):
        outcomes.append((job_id, claimer.claim(job_id).outcome))

    call_while_the_first_writes(claimer, claim, requests, release)
    assert sorted(outcome for job_id, outcome in outcomes if job_id == jobs[1]) == sorted(
        [ClaimOutcome.CLAIMED, ClaimOutcome.HELD_ELSEWHERE])
    assert all(outcome is ClaimOutcome.CLAIMED for job_id, outcome in outcomes if job_id != jobs[1])
    assert claimer.statements == 1 and not claimer._writing and not claimer._waiting
    assert {job_row(db_sessionmaker, job_id).attempt for job_id in jobs} == {1}


def test_several_jobs_are_recorded_in_one_statement(make_job, db_sessionmaker, tenant):
    from rein.worker.recorder import record_jobs

    messages = [make_job() for _ in range(3)]
    leases = [claim_job(db_sessionmaker, m.job_id, "w1", 600).lease for m in messages]
    lost = leases[2]
    with db_sessionmaker.begin() as session:   # the third job's lease went to another attempt
        session.execute(update(Job).where(Job.id == lost.job_id).values(attempt=Job.attempt + 1))
    records = [JobRecord(status="succeeded", text="hé\x00llo", token_ids=[7, 8, 9], finish_reason="stop",
                         prompt_tokens=4, completion_tokens=3, cached_tokens=9),
               JobRecord(status="failed", error={"message": "boom", "type": "server_error", "code": "x"}),
               JobRecord(status="succeeded", text="z", token_ids=[1], finish_reason="length", prompt_tokens=4,
                         completion_tokens=1)]
    recorded = record_jobs(db_sessionmaker, list(zip(leases, records, strict=True)))
    assert recorded == {leases[0].job_id, leases[1].job_id}
    assert record_jobs(db_sessionmaker, list(zip(leases, records, strict=True))) == set()   # a retry: nothing
    with db_sessionmaker() as session:
        first, second, third = (session.get(Job, lease.job_id) for lease in leases)
        assert first.status == "succeeded" and first.finished_at is not None and first.lease_expires_at is None
        assert second.status == "failed" and second.error["message"] == "boom"
        assert third.status == "running"
        result = session.get(Result, leases[0].job_id)
        assert (result.text, result.token_ids, result.finish_reason) == ("héllo", [7, 8, 9], "stop")
        assert session.get(Result, leases[1].job_id) is None and session.get(Result, lost.job_id) is None
    [usage] = usage_rows(db_sessionmaker, leases[0].job_id)
    assert (usage.tenant, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (tenant, 4, 3, 4)
    assert usage_rows(db_sessionmaker, leases[1].job_id) == usage_rows(db_sessionmaker, lost.job_id) == []


def test_group_recorder_answers_each_thread_and_groups_what_waits(make_job, db_sessionmaker, monkeypatch):
    import rein.worker.recorder as recorder_module
    from rein.worker.recorder import GroupRecorder

    recorder = GroupRecorder(db_sessionmaker)
    messages = [make_job() for _ in range(12)]
    leases = [claim_job(db_sessionmaker, m.job_id, "w1", 600).lease for m in messages]
    stale = leases[-1]
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == stale.job_id).values(attempt=Job.attempt + 1))
    # The first writer is held up, so the other threads' records wait and go as one group.
    real, release = recorder_module.record_job, threading.Event()

    def slow_record(*args, **kwargs):
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(recorder_module, "record_job", slow_record)
    answers: dict[str, bool] = {}

    def record(lease):
        answers[lease.job_id] = recorder.record(lease, JobRecord(status="succeeded", text="x", token_ids=[1],
                                                                 finish_reason="stop", prompt_tokens=4,
                                                                 completion_tokens=1))

    call_while_the_first_writes(recorder, record, leases, release)
    assert answers == {lease.job_id: lease is not stale for lease in leases}
    assert recorder.statements == 1 and not recorder._writing and not recorder._waiting
    assert all(job_row(db_sessionmaker, lease.job_id).status == "succeeded" for lease in leases[:-1])


def test_group_recorder_announces_recorded_batch_lines_only(make_job, db_sessionmaker):
    """The batch managers are woken (rein.batches.wakeup) for a recorded batch line, not for an
    interactive job nor for a line whose lease was lost."""
    from dataclasses import replace

    from rein.worker.recorder import GroupRecorder

    announced: list[int] = []
    recorder = GroupRecorder(db_sessionmaker, on_batch_lines=lambda: announced.append(1))
    done = JobRecord(status="succeeded", text="x", token_ids=[1], finish_reason="stop", prompt_tokens=4,
                     completion_tokens=1)
    interactive, line, lost = (claim_job(db_sessionmaker, make_job().job_id, "w1", 600).lease for _ in range(3))
    assert recorder.record(interactive, done) and announced == []
    assert recorder.record(replace(line, batch_id="batch_x"), done) and announced == [1]
    assert not recorder.record(replace(lost, batch_id="batch_x", attempt=lost.attempt + 1), done)
    assert announced == [1]


def test_expired_lease_is_reclaimed_and_the_stale_attempt_writes_nothing(make_job, db_sessionmaker):
    message = make_job()
    stale = claim_job(db_sessionmaker, message.job_id, "w1", 600).lease
    with db_sessionmaker.begin() as session:   # w1 vanished long ago
        session.execute(update(Job).where(Job.id == message.job_id)
                        .values(lease_expires_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 1)))
    fresh = claim_job(db_sessionmaker, message.job_id, "w2", 600).lease
    assert fresh.attempt == 2 and fresh.worker == "w2"
    # w1 died, not the job: as when the reaper takes the lease, the attempt is refunded and no
    # death is counted against the job (rein.worker.suspects).
    assert fresh.deaths_seen == 0 and job_row(db_sessionmaker, message.job_id).attempts_refunded == 1
    done = JobRecord(status="succeeded", text="x", token_ids=[1], finish_reason="stop", prompt_tokens=4,
                     completion_tokens=1)
    assert not record_job(db_sessionmaker, stale, done)
    assert record_job(db_sessionmaker, fresh, done)
    assert not release_job(db_sessionmaker, fresh)
    assert len(usage_rows(db_sessionmaker, message.job_id)) == 1


def test_recorder_writes_result_status_and_usage_once(make_job, db_sessionmaker, tenant):
    message = make_job()
    lease = claim_job(db_sessionmaker, message.job_id, "w1", 600).lease
    record = JobRecord(status="succeeded", text="hello", token_ids=[7, 8, 9], finish_reason="stop",
                       prompt_tokens=4, completion_tokens=3, cached_tokens=2)
    assert record_job(db_sessionmaker, lease, record)
    assert not record_job(db_sessionmaker, lease, record)            # the retry writes nothing
    rows = usage_rows(db_sessionmaker, message.job_id)
    assert len(rows) == 1
    usage = rows[0]
    assert (usage.tenant, usage.model, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == \
        (tenant, MODEL, 4, 3, 2)
    with db_sessionmaker() as session:
        job = session.get(Job, message.job_id)
        result = session.get(Result, message.job_id)
        assert job.status == "succeeded" and job.finished_at is not None and job.lease_expires_at is None
        assert (result.text, result.token_ids, result.finish_reason) == ("hello", [7, 8, 9], "stop")
        body = response_body(job, result)
    assert body["object"] == "text_completion" and body["id"] == f"cmpl-{message.job_id}"
    assert body["choices"][0]["text"] == "hello" and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_released_job_is_claimed_again_as_a_new_attempt(make_job, db_sessionmaker):
    message = make_job()
    lease = claim_job(db_sessionmaker, message.job_id, "w1", 600).lease
    assert release_job(db_sessionmaker, lease)
    row = job_row(db_sessionmaker, message.job_id)
    assert row.status == "queued" and row.worker is None
    assert claim_job(db_sessionmaker, message.job_id, "w2", 600).lease.attempt == 2


def test_a_job_that_keeps_losing_its_workers_is_given_up(make_job, db_sessionmaker):
    message = make_job()
    with db_sessionmaker.begin() as session:   # three attempts already started, none finished
        session.execute(update(Job).where(Job.id == message.job_id).values(attempt=3, status="queued"))
    assert claim_job(db_sessionmaker, message.job_id, "w1", 600).outcome is ClaimOutcome.GAVE_UP
    row = job_row(db_sessionmaker, message.job_id)
    assert row.status == "failed" and row.error["code"] == "too_many_attempts" and row.attempt == 3


def test_cancel_requested_while_queued_is_not_claimed(make_job, db_sessionmaker, redis_client, keys):
    message = make_job()
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == message.job_id).values(cancel_requested_at=func.now()))
    claim = claim_job(db_sessionmaker, message.job_id, "w1", 600)
    assert claim.outcome is ClaimOutcome.CANCELLED
    row = job_row(db_sessionmaker, message.job_id)
    assert row.status == "cancelled" and row.attempt == 0 and row.finished_at is not None
    assert not cancel_unstarted_job(db_sessionmaker, message.job_id)

    other = make_job()
    assert not is_cancel_requested(redis_client, keys, other.job_id)
    request_cancel(redis_client, keys, other.job_id, flag_ttl_seconds=60)
    assert is_cancel_requested(redis_client, keys, other.job_id)


def test_cancel_listener_hears_cancels_and_checks_flags_on_subscribe(redis_client, keys):
    heard: list[str] = []
    flagged = f"job_flagged_{secrets.token_hex(4)}"
    request_cancel(redis_client, keys, flagged, flag_ttl_seconds=60)   # before the listener runs
    listener = CancelListener(redis_client, keys, heard.append, running_jobs=lambda: [flagged, "job_other"],
                              wait_seconds=0.1).start()
    try:
        assert listener.subscribed.wait(10)
        request_cancel(redis_client, keys, "job_live", flag_ttl_seconds=60)
        wait_for(lambda: "job_live" in heard, 10, "the published cancel")
    finally:
        started = time.monotonic()
        listener.stop()
        assert time.monotonic() - started < 2
    assert heard == [flagged, "job_live"]


def test_cancel_listener_says_what_it_heard_since_a_mark(redis_url, redis_client, keys):
    """What a task asks after its submit (rein.worker.job_end.abort_if_cancelled): True for a
    cancel heard, False while subscribed all along, None (ask Redis) when it may have missed one."""
    import redis

    heard: list[str] = []
    name = f"rein-test-listener-{secrets.token_hex(4)}"   # to drop this listener's connection alone
    own = redis.Redis.from_url(redis_url, client_name=name)
    listener = CancelListener(own, keys, heard.append, wait_seconds=0.1)
    assert listener.mark() is None                      # not subscribed yet
    listener.start()
    try:
        assert listener.subscribed.wait(10)
        mark = listener.mark()
        assert mark is not None
        assert listener.heard_since("job_quiet", mark) is False
        assert listener.heard_since("job_quiet", None) is None
        request_cancel(redis_client, keys, "job_loud", flag_ttl_seconds=60)
        wait_for(lambda: "job_loud" in heard, 10, "the published cancel")
        assert listener.heard_since("job_loud", mark) is True
        assert listener.heard_since("job_loud", None) is True
        # A new subscription (after a lost connection) may have missed cancels: ask Redis.
        for client in redis_client.client_list(_type="pubsub"):
            if client.get("name") == name:
                redis_client.client_kill_filter(_id=client["id"])
        wait_for(lambda: listener.mark() not in (None, mark), 10, "the listener to subscribe again")
        assert listener.heard_since("job_quiet", mark) is None
        assert listener.heard_since("job_quiet", listener.mark()) is False
    finally:
        listener.stop()
        own.close()


# -- queues and priorities ----------------------------------------------------------------------


def test_interactive_jobs_are_taken_before_batch_jobs(settings, make_job, redis_client):
    from kombu import Consumer, Queue

    app = make_worker_celery(settings)
    model = f"prio{secrets.token_hex(3)}"                     # queues no worker consumes
    batch = [make_job(model=model, priority=PRIORITY_BATCH) for _ in range(2)]
    interactive = make_job(model=model, priority=PRIORITY_INTERACTIVE)
    for message in [*batch, interactive]:
        enqueue_job(app, message)
    # Each kind on its model's queue of that kind, at its priority step.
    depth_keys = queue_keys(settings, model)
    assert all(k.startswith(settings.redis_key_prefix) for k in depth_keys)
    keys = RedisKeys.from_settings(settings)
    assert depth_keys[PRIORITY_INTERACTIVE] == settings.redis_key_prefix + keys.queue(model)
    assert depth_keys[PRIORITY_BATCH] == f"{settings.redis_key_prefix}{keys.batch_queue(model)}:{PRIORITY_BATCH}"
    # (make_job's messages are on batch shard 0: the plain name)
    assert [redis_client.llen(k) for k in depth_keys] == [1, 0, 0, 0, 0, 0, 2] + [0] * (len(depth_keys) - 7)
    # A consumer of both queues (as a worker's) takes the interactive job first.
    taken = []
    with app.connection_for_read() as conn:
        consumer = Consumer(conn.default_channel, [Queue(q) for q in worker_queues(settings, model)],
                            callbacks=[lambda body, message: (taken.append(body[0][0]["job_id"]), message.ack())],
                            accept=["json"])
        with consumer:
            while len(taken) < 3:
                conn.drain_events(timeout=5)
    assert taken == [interactive.job_id, batch[0].job_id, batch[1].job_id]


# -- a worker in this process ------------------------------------------------------------------


class InProcessWorker:
    """A Celery worker (threads pool, the engine bootstep) in a thread of this process.

    One at a time: Celery keeps worker state per process, and `stop()` is a warm shutdown
    as SIGTERM does it, through the process-wide flag.
    """

    def __init__(self, app, queues: list[str], concurrency: int) -> None:
        from celery.contrib.testing.worker import TestWorkController, setup_app_for_worker

        from rein.worker.bootstep import EngineThreadPool

        setup_app_for_worker(app, "WARNING", None)
        self.app = app
        self.worker = TestWorkController(app=app, concurrency=concurrency, pool=EngineThreadPool,
                                         hostname=f"test-{secrets.token_hex(3)}@localhost", queues=queues,
                                         without_heartbeat=True, without_mingle=True, without_gossip=True,
                                         loglevel="WARNING", ready_callback=None)
        self.thread = threading.Thread(target=self.worker.start, name="test-worker", daemon=True)
        self.thread.start()
        self.worker.ensure_started()

    def stop(self, timeout: float = 30.0) -> float:
        """Warm shutdown; returns the seconds it took."""
        from celery.worker import state

        started = time.monotonic()
        state.should_stop = 0
        try:
            self.thread.join(timeout)
        finally:
            state.should_stop = None
        assert not self.thread.is_alive(), f"the worker did not stop within {timeout} s"
        return time.monotonic() - started


@pytest.fixture(scope="module")
def worker_app(make_settings, tiny_models) -> Iterator:
    """The app of an in-process worker for MODEL (tiny model, 4 threads); the shutdown test stops it."""
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.bootstep import configure_worker
    from rein.worker.context import WorkerSpec

    settings = make_settings(job_timeout_seconds=60, max_num_seqs=4, stream_ttl_seconds=300)
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                          max_num_seqs=4)
    app = make_worker_celery(settings)
    configure_worker(app, WorkerSpec(settings=settings, model_name=MODEL,
                                     engine_factory=lambda: LLMEngine(config)))
    handle = InProcessWorker(app, worker_queues(settings, MODEL), concurrency=4)
    app.rein_test_worker = handle
    yield app
    if handle.thread.is_alive():
        handle.stop()


def wait_finished(sessions, job_id: str) -> Job:
    return wait_for(lambda: (row := job_row(sessions, job_id)).status in ("succeeded", "failed", "cancelled")
                    and row, what=f"job {job_id} to finish")


def test_worker_runs_a_job_end_to_end(worker_app, make_job, db_sessionmaker, redis_client, keys, tenant):
    context = worker_app.rein_context
    message = make_job(endpoint="/v1/chat/completions", max_tokens=8)
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "succeeded", job.error
    assert job.attempt == 1 and job.worker == context.worker_name
    assert job.queued_at <= job.started_at <= job.first_token_at <= job.finished_at

    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    events = stream_events(redis_client, keys, message.job_id)
    assert [entry_id for entry_id, _ in events] == [f"{n}-0" for n in range(1, len(events) + 1)]
    assert "".join(e.text for _, e in events) == result.text
    assert [t for _, e in events for t in e.token_ids] == result.token_ids
    assert len(result.token_ids) == 8 and result.finish_reason == "length"
    assert events[-1][1].usage == {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    [usage] = usage_rows(db_sessionmaker, message.job_id)
    assert (usage.tenant, usage.key_id, usage.model) == (tenant, message.key_id, MODEL)
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 8)
    body = response_body(job, result)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == result.text

    enqueue_job(worker_app, message)                 # a redelivered message: nothing runs twice
    marker = make_job(max_tokens=1)                  # jobs run in order on this quiet queue
    enqueue_job(worker_app, marker)
    wait_finished(db_sessionmaker, marker.job_id)
    time.sleep(0.2)
    assert job_row(db_sessionmaker, message.job_id).attempt == 1
    assert len(usage_rows(db_sessionmaker, message.job_id)) == 1
    assert len(stream_events(redis_client, keys, message.job_id)) == len(events)
    assert context.engine.pool.num_free == context.engine.pool.num_blocks


def test_worker_stores_logprobs_in_the_response_shape(worker_app, make_job, db_sessionmaker):
    message = make_job(max_tokens=3, logprobs=2)
    message.logprobs_mode = 2
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    logprobs = response_body(job, result)["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3 and len(logprobs["top_logprobs"]) == 3


def test_worker_records_every_choice(worker_app, make_job, db_sessionmaker, redis_client, keys):
    """n=3: each choice's events carry its index; the record keeps choice 0 in its columns,
    all three in results.response, and usage sums them (the prompt once)."""
    message = make_job(max_tokens=6, n=3, temperature=1.0, seed=9)
    message.shape = {"n": 3}
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "succeeded", job.error
    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    body = response_body(job, result)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][0]["text"] == result.text and len(result.token_ids) == 6
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 18
    [usage] = usage_rows(db_sessionmaker, message.job_id)
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 18)
    events = [e for _, e in stream_events(redis_client, keys, message.job_id)]
    for index, choice in enumerate(body["choices"]):
        assert "".join(e.text for e in events if e.index == index) == choice["text"]
    assert events[-1].final and events[-1].usage["completion_tokens"] == 18
    assert sum(1 for e in events if e.choice_finish_reason) == 3
    assert worker_app.rein_context.engine.pool.num_free == worker_app.rein_context.engine.pool.num_blocks


def test_worker_echo_stores_the_echoed_body(worker_app, make_job, db_sessionmaker):
    message = make_job(max_tokens=3)
    message.shape = {"n": 1, "echo": "ECHO:"}
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    assert result.response is not None and not result.text.startswith("ECHO:")
    body = response_body(job, result)
    assert body["choices"][0]["text"] == "ECHO:" + result.text
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == 4


def test_cancel_mid_generation_frees_the_engine_blocks(worker_app, make_job, db_sessionmaker, redis_client,
                                                        keys):
    engine = worker_app.rein_context.engine
    message = make_job(max_tokens=900)
    enqueue_job(worker_app, message)
    wait_for(lambda: len(stream_events(redis_client, keys, message.job_id)) >= 2, what="the first events")
    assert engine.pool.num_free < engine.pool.num_blocks
    request_cancel(redis_client, keys, message.job_id, flag_ttl_seconds=60)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "cancelled"
    wait_for(lambda: engine.pool.num_free == engine.pool.num_blocks, 10, "the blocks to come back")
    events = stream_events(redis_client, keys, message.job_id)
    final = events[-1][1]
    assert final.finish_reason == "abort" and final.usage["completion_tokens"] < 900
    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    assert result.finish_reason == "abort" and "".join(e.text for _, e in events) == result.text
    [usage] = usage_rows(db_sessionmaker, message.job_id)
    assert usage.completion_tokens == len(result.token_ids) == final.usage["completion_tokens"]


def test_job_cancelled_while_queued_is_skipped(worker_app, make_job, db_sessionmaker, redis_client, keys):
    # As every cancel path does: the row's cancel_requested_at first, then the flag and the
    # message (rein.worker.cancel). The claim refuses the job; the worker ends its stream.
    message = make_job()
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == message.job_id).values(cancel_requested_at=func.now()))
    request_cancel(redis_client, keys, message.job_id, flag_ttl_seconds=60)
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "cancelled" and job.attempt == 0
    [(_, event)] = stream_events(redis_client, keys, message.job_id)
    assert event.finish_reason == "abort" and event.seq == 1
    assert usage_rows(db_sessionmaker, message.job_id) == []


def test_job_the_engine_refuses_fails_with_its_reason(worker_app, make_job, db_sessionmaker, redis_client, keys):
    message = make_job(max_tokens=5000)               # beyond max_model_len 1024
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "failed" and job.error["code"] == "context_length_exceeded"
    [(_, event)] = stream_events(redis_client, keys, message.job_id)
    assert event.error and "maximum context length" in event.error
    assert usage_rows(db_sessionmaker, message.job_id) == []


def test_a_grammar_the_engine_cannot_compile_fails_its_job_with_the_reason(worker_app, make_job, db_sessionmaker,
                                                                          redis_client, keys, monkeypatch):
    """Not `cancelled`: the job failed for its own fault, and its stream and record say why."""
    from rein.engine.structured import decoding
    from rein.engine.structured.cache import GrammarError

    cache = worker_app.rein_context.engine.grammars.cache

    def refuses(key, spec):   # slowly: the request is held, then ended when the compile fails
        time.sleep(0.5)
        raise GrammarError("the grammar's rule r7 is left recursive")

    monkeypatch.setattr(cache, "_compile", refuses)
    monkeypatch.setattr(decoding, "check_spec", lambda spec, param: None)
    message = make_job(structured={"type": "regex", "pattern": "[ab]{4}-never-compiled"})
    enqueue_job(worker_app, message)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "failed", job.status
    assert job.error["code"] == "invalid_request" and "left recursive" in job.error["message"]
    [(_, event)] = stream_events(redis_client, keys, message.job_id)
    assert event.error and "left recursive" in event.error


def test_interrupted_job_is_handed_back_to_the_queue(worker_app, make_job, db_sessionmaker, redis_client, keys):
    """What a broker connection loss does: Celery terminates the task; the job goes back."""
    context = worker_app.rein_context
    message = make_job(max_tokens=900, model=MODEL)
    enqueue_job(worker_app, message)
    wait_for(lambda: message.job_id in context.jobs.running_jobs() and stream_events(redis_client, keys, message.job_id),
             what="the job to run")
    # What the consumer does on connection loss (worker_cancel_long_running_tasks_on_connection_loss).
    from celery.worker.state import active_requests

    [request] = [r for r in tuple(active_requests) if r.args and r.args[0]["job_id"] == message.job_id]
    request.cancel(worker_app.rein_test_worker.worker.pool)
    # Handed back and, with a fresh message, taken again by this same worker as attempt 2.
    wait_for(lambda: job_row(db_sessionmaker, message.job_id).attempt == 2, what="the second attempt")
    wait_for(lambda: len(stream_events(redis_client, keys, message.job_id)) >= 1, what="the restarted stream")
    request_cancel(redis_client, keys, message.job_id, flag_ttl_seconds=60)
    job = wait_finished(db_sessionmaker, message.job_id)
    assert job.status == "cancelled" and job.attempt == 2
    events = stream_events(redis_client, keys, message.job_id)
    assert [e.seq for _, e in events] == list(range(1, len(events) + 1))
    with db_sessionmaker() as session:
        assert "".join(e.text for _, e in events) == session.get(Result, message.job_id).text
    assert len(usage_rows(db_sessionmaker, message.job_id)) == 1


def test_process_job_without_a_broker_fails_a_job_past_its_time_limit(make_settings, tiny_models, make_job,
                                                                     db_sessionmaker, redis_client):
    """The task's logic is a plain function: run it on a context built without Celery."""
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context
    from rein.worker.tasks import process_job

    settings = make_settings(job_timeout_seconds=1)
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                          max_num_seqs=2)

    def slow_engine() -> LLMEngine:
        # At least 5 ms a step: 1000 tokens take 5 s, past the 1 s limit however fast the machine.
        engine = LLMEngine(config)
        step = engine.step
        engine.step = lambda: (time.sleep(0.005), step())[1]
        return engine

    spec = WorkerSpec(settings=settings, model_name=MODEL, engine_factory=slow_engine)
    context = build_context(make_worker_celery(settings), spec, "plain@test")
    try:
        message = make_job(max_tokens=1000)
        assert process_job(context, message) == "failed"
    finally:
        context.stop()
    job = job_row(db_sessionmaker, message.job_id)
    assert job.status == "failed" and job.error["code"] == "timeout"
    with db_sessionmaker() as session:
        result = session.get(Result, message.job_id)
    [usage] = usage_rows(db_sessionmaker, message.job_id)
    assert usage.completion_tokens == len(result.token_ids) < 1000     # the tokens it did use are billed
    events = stream_events(redis_client, RedisKeys.from_settings(settings), message.job_id)
    final = events[-1][1]
    assert final.error and "time limit" in final.error and final.finish_reason == "abort"
    assert "".join(e.text for _, e in events) == result.text
    assert context.engine.pool.num_free == context.engine.pool.num_blocks


@pytest.fixture
def plain_context(make_settings, tiny_models):
    """`plain_context(**settings)`: a worker context built without Celery (stopped after the test)."""
    from rein.engine import EngineConfig, LLMEngine
    from rein.worker.context import WorkerSpec, build_context

    built = []

    def make(**overrides):
        settings = make_settings(**overrides)
        config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                              max_num_seqs=2)
        spec = WorkerSpec(settings=settings, model_name=MODEL, engine_factory=lambda: LLMEngine(config))
        built.append(build_context(make_worker_celery(settings), spec, f"plain-{secrets.token_hex(3)}@test"))
        return built[-1]

    yield make
    for context in built:
        context.stop()


def test_a_finished_result_waits_out_a_postgres_outage(plain_context, make_job, db_sessionmaker, monkeypatch):
    from sqlalchemy.exc import OperationalError

    import rein.worker.job_end as job_end
    import rein.worker.recorder as recorder
    import rein.worker.tasks as tasks

    context = plain_context()
    real_record, failures = recorder.record_job, []

    def record_while_postgres_is_down(*args, **kwargs):
        if len(failures) < 3:
            failures.append(1)
            raise OperationalError("UPDATE jobs ...", {}, ConnectionRefusedError("Postgres is down"))
        return real_record(*args, **kwargs)

    # The worker's GroupRecorder writes a job alone through recorder.record_job.
    assert context.recorder is not None
    monkeypatch.setattr(recorder, "record_job", record_while_postgres_is_down)
    monkeypatch.setattr(job_end, "record_job", record_while_postgres_is_down)
    message = make_job(max_tokens=5)
    assert tasks.process_job(context, message) == "succeeded"
    assert len(failures) == 3
    assert job_row(db_sessionmaker, message.job_id).status == "succeeded"
    assert usage_rows(db_sessionmaker, message.job_id)[0].completion_tokens == 5


def test_redis_failing_mid_job_hands_the_job_back(plain_context, make_job, db_sessionmaker, monkeypatch):
    from redis.exceptions import ConnectionError as RedisConnectionError

    from rein.worker.tasks import process_job

    context = plain_context()

    def begin(job_id, restart=False, coalesce=False):
        raise RedisConnectionError("Redis is restarting")

    monkeypatch.setattr(context.publisher, "begin", begin)
    # A model no worker of this test run consumes: the job must stay as handed back.
    message = make_job(max_tokens=5, model=f"m{secrets.token_hex(3)}")
    assert process_job(context, message) == "requeued"
    job = job_row(db_sessionmaker, message.job_id)
    assert job.status == "queued" and job.attempt == 1 and job.error is None


def test_a_job_whose_lease_was_lost_is_stopped(plain_context, make_job, db_sessionmaker):
    from rein.worker.tasks import process_job

    context = plain_context(lease_seconds=2, lease_renew_seconds=0.5)
    message = make_job(max_tokens=100_000 // 200, ignore_eos=True)
    outcome: list[str] = []
    runner = threading.Thread(target=lambda: outcome.append(process_job(context, message)))
    runner.start()
    wait_for(lambda: job_row(db_sessionmaker, message.job_id).status == "running", what="the job to start")
    with db_sessionmaker.begin() as session:    # the reaper gave it to another attempt meanwhile
        session.execute(update(Job).where(Job.id == message.job_id).values(attempt=Job.attempt + 1, worker="other"))
    runner.join(30)
    assert outcome == ["lease lost"]
    assert context.engine.num_running == 0
    assert usage_rows(db_sessionmaker, message.job_id) == []


def test_an_interactive_job_starts_while_batch_jobs_hold_every_slot(worker_app, make_job, db_sessionmaker,
                                                                     redis_client, keys):
    """Batch jobs fill the worker's max_num_seqs slots (and one more waits): the interactive
    job is still taken, on the slot kept for it, and the engine preempts a batch request
    for it, so it finishes while every batch job still runs."""
    context = worker_app.rein_context
    slots = context.engine.config.max_num_seqs
    preemptions = context.engine.scheduler.num_priority_preemptions
    batch = [make_job(max_tokens=900, priority=PRIORITY_BATCH) for _ in range(slots + 1)]
    for message in batch:
        enqueue_job(worker_app, message)
    try:
        wait_for(lambda: [job_row(db_sessionmaker, m.job_id).status for m in batch].count("running") == slots
                 and context.engine.num_running == slots, what="batch jobs in every slot")
        chat = make_job(max_tokens=4)
        enqueue_job(worker_app, chat)
        assert wait_finished(db_sessionmaker, chat.job_id).status == "succeeded"
        statuses = [job_row(db_sessionmaker, m.job_id).status for m in batch]
        # None finished, and the extra batch job did not take the interactive slot.
        assert sorted(statuses) == ["queued"] + ["running"] * slots
        assert context.engine.scheduler.num_priority_preemptions > preemptions
    finally:
        for message in batch:
            request_cancel(redis_client, keys, message.job_id, flag_ttl_seconds=60)
        for message in batch:
            wait_finished(db_sessionmaker, message.job_id)


# -- shutdown and the CLI --------------------------------------------------------------------------


def test_warm_shutdown_hands_running_jobs_back_and_exits_promptly(worker_app, make_job, db_sessionmaker,
                                                                 redis_client, keys):
    """Stops the module's worker: keep it the last test that uses `worker_app`."""
    settings = worker_app.rein_settings
    # At least 20 ms a step: the job's 900 tokens take 18 s, past the stop's 10 s however fast
    # the machine or slow the stop on a loaded one (else the job may end before it is handed back).
    engine = worker_app.rein_context.engine
    step = engine.step
    engine.step = lambda: (time.sleep(0.02), step())[1]
    message = make_job(max_tokens=900)
    enqueue_job(worker_app, message)
    wait_for(lambda: stream_events(redis_client, keys, message.job_id), what="the job to run")
    assert worker_app.rein_test_worker.stop() < 10
    assert not [t for t in threading.enumerate() if t.name == f"rein-engine-{MODEL}"]
    job = job_row(db_sessionmaker, message.job_id)
    assert job.status == "queued" and job.attempt == 1 and job.worker is None
    depth = sum(redis_client.llen(k) for k in queue_keys(settings, MODEL))
    assert depth == 1                                   # one message waits for the next worker
    events = stream_events(redis_client, keys, message.job_id)
    assert events and not any(e.final for _, e in events)     # no false "finished" for the client


def test_worker_cli_refuses_an_unmigrated_database(make_database, settings_env, monkeypatch, capsys):
    from rein.cli.main import main
    from rein.core.settings import get_settings

    monkeypatch.setenv("REIN_MODELS", "tiny=/nonexistent")
    get_settings.cache_clear()
    assert main(["worker", "--model", "tiny"]) == 2              # migrated, but no such model
    assert "/nonexistent does not exist" in capsys.readouterr().err
    assert main(["worker", "--model", "other"]) == 2
    assert "'other' is not served" in capsys.readouterr().err

    monkeypatch.setenv("REIN_DATABASE_URL", make_database())    # an empty database
    get_settings.cache_clear()
    assert main(["worker", "--model", "tiny"]) == 2
    assert "not migrated" in capsys.readouterr().err


def test_a_batched_send_makes_the_same_celery_message_as_a_single_one(settings, redis_client):
    """enqueue_jobs publishes through kombu directly; a worker must not be able to tell."""
    import base64
    import json

    from rein.jobs.queues import enqueue_jobs

    app = make_worker_celery(settings)
    model = f"m{secrets.token_hex(3)}"
    message = JobMessage(job_id="job_same", model=model, endpoint="/v1/completions",
                         prompt_token_ids=[5, 6, 7], sampling={"max_tokens": 3}, priority=PRIORITY_BATCH,
                         tenant="t", key_id="k")
    try:
        enqueue_job(app, message)
        enqueue_jobs(app, [message, message])
    finally:
        app.close()
    raw = [m for q in queue_keys(settings, model) for m in redis_client.lrange(q, 0, -1)]
    assert len(raw) == 3
    # Both went to the batch priority's list, none to the interactive one.
    assert redis_client.llen(queue_keys(settings, model)[0]) == 0
    single, *batched = [json.loads(m) for m in reversed(raw)]        # LPUSH: the oldest is last

    def comparable(envelope: dict) -> dict:
        task_id = envelope["headers"]["id"]
        props = dict(envelope["properties"], delivery_tag=None)
        assert props["correlation_id"] == task_id
        # send_task also copies argsrepr and kwargsrepr into the properties, which no
        # consumer reads (they are in the headers, compared below).
        return {"body": json.loads(base64.b64decode(envelope["body"])),
                "headers": {k: v for k, v in envelope["headers"].items() if k not in ("id", "root_id")},
                "properties": {k: v for k, v in props.items()
                               if k not in ("correlation_id", "argsrepr", "kwargsrepr")},
                "content": (envelope["content-type"], envelope["content-encoding"])}

    for envelope in batched:
        assert comparable(envelope) == comparable(single)
    assert comparable(single)["body"][0] == [message.to_dict()]
    assert comparable(single)["headers"]["argsrepr"] == "[job_same]"   # no token ids in Celery's logs

