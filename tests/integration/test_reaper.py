"""Leases and the reaper against real Postgres and Redis: renewal, expired leases queued again
(or cancelled, or given up), lost messages sent again without flooding the queue, the
advisory lock, and the wait after a Postgres outage."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import pytest
from sqlalchemy import func, select, update
from support import queued_job_ids

from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.jobs.claim import MAX_STARTS, claim_job, renew_leases
from rein.jobs.queues import queue_keys
from rein.jobs.reaper import Reaper
from rein.store.tables import ApiKey, Job
from rein.worker.app import make_worker_celery


@pytest.fixture
def model() -> str:
    """A model name of this test alone: its queue holds only this test's messages."""
    return f"m{secrets.token_hex(4)}"


@pytest.fixture
def celery(settings):
    app = make_worker_celery(settings)
    yield app
    app.close()


@pytest.fixture
def reaper(settings, db_sessionmaker, redis_client, celery) -> Reaper:
    return Reaper(settings, db_sessionmaker, redis_client, celery)


@pytest.fixture
def make_job(db_sessionmaker, tenant, model) -> Callable[..., str]:
    """Insert a job of `model` (queued, sent `sent_ago` seconds ago unless None); its id."""
    key_id = f"k{secrets.token_hex(6)}"
    with db_sessionmaker.begin() as session:
        session.add(ApiKey(key_id=key_id, name="test", tenant=tenant, secret_hash=b"x" * 32, scopes=["inference"]))

    def make(sent_ago: float | None = 60.0, priority: int = PRIORITY_INTERACTIVE) -> str:
        job = Job(tenant=tenant, key_id=key_id, model=model, endpoint="/v1/completions",
                  params={"body": {}, "sampling": {"max_tokens": 4}, "logprobs_mode": None},
                  prompt_token_ids=[5, 6, 7], prompt_tokens=3, priority=priority)
        with db_sessionmaker.begin() as session:
            session.add(job)
            session.flush()
            if sent_ago is not None:
                session.execute(update(Job).where(Job.id == job.id)
                                .values(sent_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 0, sent_ago)))
        return job.id

    return make


def row(sessions, job_id: str) -> Job:
    with sessions() as session:
        return session.get(Job, job_id)


def queued_messages(redis_client, settings, model: str, priority: int = PRIORITY_INTERACTIVE) -> list[str]:
    """The job ids of the messages waiting on the model's queue list of that priority."""
    return queued_job_ids(redis_client, queue_keys(settings, model)[priority])


def expire_lease(sessions, job_id: str) -> None:
    with sessions.begin() as session:
        session.execute(update(Job).where(Job.id == job_id)
                        .values(lease_expires_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 0, 1)))


def test_renewal_extends_the_leases_this_worker_holds_and_reports_lost_ones(make_job, db_sessionmaker):
    mine, taken = make_job(), make_job()
    lease = claim_job(db_sessionmaker, mine, "w1", 5).lease
    stale = claim_job(db_sessionmaker, taken, "w1", 5).lease
    expire_lease(db_sessionmaker, taken)
    other = claim_job(db_sessionmaker, taken, "w2", 30).lease    # another attempt took it over
    assert other.attempt == 2
    before = row(db_sessionmaker, mine).lease_expires_at
    held = renew_leases(db_sessionmaker, "w1", [lease, stale], 300)
    assert held == {(mine, 1)}
    assert (row(db_sessionmaker, mine).lease_expires_at - before).total_seconds() > 200
    assert renew_leases(db_sessionmaker, "w1", [], 300) == set()


def test_expired_leases_are_queued_again_cancelled_or_given_up(make_job, reaper, db_sessionmaker,
                                                                redis_client, settings, model):
    lost, cancelled, exhausted, live = make_job(), make_job(), make_job(), make_job()
    for job_id in (lost, cancelled, exhausted, live):
        claim_job(db_sessionmaker, job_id, "dead-worker", 300)
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == cancelled).values(cancel_requested_at=func.now()))
        session.execute(update(Job).where(Job.id == exhausted).values(attempt=MAX_STARTS))
    for job_id in (lost, cancelled, exhausted):
        expire_lease(db_sessionmaker, job_id)

    report = reaper.reap(take_leases=True)
    assert report.ran and report.requeued >= 1 and report.cancelled >= 1 and report.gave_up >= 1

    requeued = row(db_sessionmaker, lost)
    assert requeued.status == "queued" and requeued.worker is None and requeued.lease_expires_at is None
    # Its worker vanished whole, not the job's fault: the attempt is refunded, no death counted.
    assert (requeued.attempt, requeued.attempts_refunded, requeued.deaths_seen) == (1, 1, 0)
    assert queued_messages(redis_client, settings, model) == [lost]       # one new message
    assert row(db_sessionmaker, cancelled).status == "cancelled"
    gave_up = row(db_sessionmaker, exhausted)
    assert gave_up.status == "failed" and gave_up.error["code"] == "too_many_attempts"
    assert row(db_sessionmaker, live).status == "running"                 # its lease still runs

    # The new attempt runs it; the dead worker's late redelivery finds it held and does nothing.
    lease = claim_job(db_sessionmaker, lost, "w2", 30).lease
    assert (lease.attempt, lease.deaths_seen, lease.suspect_group) == (2, 0, None)
    assert claim_job(db_sessionmaker, lost, "dead-worker", 30).lease is None


def test_a_worker_gone_whole_counts_no_death_against_its_jobs(make_job, reaper, db_sessionmaker):
    """A worker SIGKILLed with its jobs: whether the reaper or the next claim takes an expired
    lease back, the attempt is refunded and the job's engine deaths and suspect group stay as
    they were (rein.worker.suspects: only an engine dying under a live worker is evidence)."""
    fresh, suspect = make_job(), make_job()
    with db_sessionmaker.begin() as session:
        session.execute(update(Job).where(Job.id == suspect)
                        .values(deaths_seen=1, suspect_group="d.0.1", suspect_group_size=4))
    for worker in ("dead-1", "dead-2"):
        for job_id in (fresh, suspect):
            claim_job(db_sessionmaker, job_id, worker, 300)
            expire_lease(db_sessionmaker, job_id)
        if worker == "dead-1":
            reaper.reap(take_leases=True)         # the reaper takes the first worker's leases back
    # The second worker's: its jobs' next claim takes them back.
    leases = {job_id: claim_job(db_sessionmaker, job_id, "w3", 30).lease for job_id in (fresh, suspect)}
    assert (leases[fresh].attempt, leases[fresh].deaths_seen, leases[fresh].suspect_group) == (3, 0, None)
    assert (leases[suspect].attempt, leases[suspect].deaths_seen, leases[suspect].suspect_group,
            leases[suspect].suspect_group_size) == (3, 1, "d.0.1", 4)
    for job_id in (fresh, suspect):
        assert row(db_sessionmaker, job_id).attempts_refunded == 2


def test_after_a_postgres_outage_leases_are_not_taken_before_workers_could_renew(make_job, reaper,
                                                                                  db_sessionmaker):
    job_id = make_job()
    claim_job(db_sessionmaker, job_id, "w1", 300)
    expire_lease(db_sessionmaker, job_id)
    reaper.reap()              # its first pass: it cannot tell how long Postgres has been up
    assert row(db_sessionmaker, job_id).status == "running"
    reaper._db_up_since -= reaper.settings.lease_renew_seconds + 5
    reaper.reap()
    assert row(db_sessionmaker, job_id).status == "queued"


def test_lost_messages_are_sent_again_but_the_queue_is_not_flooded(make_job, reaper, db_sessionmaker,
                                                                   redis_client, settings, model, celery):
    from rein.jobs.queues import enqueue_job
    from rein.store.messages import JobMessage

    oldest, older, waiting = make_job(sent_ago=90), make_job(sent_ago=60), make_job(sent_ago=30)
    fresh = make_job(sent_ago=1)            # sent a moment ago: within the bound, left alone
    unsent = make_job(sent_ago=None)         # a batch line the batch manager has not sent
    with db_sessionmaker() as session:       # the newest sent message is on the queue
        enqueue_job(celery, JobMessage.for_job(session.get(Job, fresh)))
        enqueue_job(celery, JobMessage.for_job(session.get(Job, waiting)))
    # Two messages wait: they stand for the two jobs sent last (fresh, waiting); the two sent
    # before them have lost theirs.
    # (The reaper sees the whole test database: count this test's model's queue, not the report.)
    assert reaper.reap().resent >= 2
    assert sorted(queued_messages(redis_client, settings, model)) == sorted([fresh, waiting, oldest, older])
    assert row(db_sessionmaker, unsent).sent_at is None
    # Next pass: all four queued-and-sent jobs are accounted for by the four messages.
    reaper.reap()
    assert len(queued_messages(redis_client, settings, model)) == 4


def test_batch_priority_is_counted_on_its_own_list(make_job, reaper, redis_client, settings, model):
    job_id = make_job(sent_ago=60, priority=PRIORITY_BATCH)
    reaper.reap()
    assert queued_messages(redis_client, settings, model, PRIORITY_BATCH) == [job_id]
    assert queued_messages(redis_client, settings, model, PRIORITY_INTERACTIVE) == []


def test_after_redis_restarts_every_queued_job_is_sent_at_once(make_job, reaper, redis_client, settings, model):
    job_id = make_job(sent_ago=1)
    reaper.reap()
    assert queued_messages(redis_client, settings, model) == []         # within the bound
    reaper._redis_run_id = "a-run-before-the-restart"
    reaper.reap()                                    # a new run id: its messages are gone
    assert queued_messages(redis_client, settings, model) == [job_id]


def test_one_reaper_pass_at_a_time(make_job, reaper, redis_client, settings, model, db_engine):
    from rein.jobs.reaper import LOCK_ID

    job_id = make_job(sent_ago=60)           # its message is lost: a pass would send it again
    with db_engine.connect() as other, other.begin():
        other.execute(select(func.pg_advisory_xact_lock(LOCK_ID)))     # another reaper's pass
        assert not reaper.reap().ran
        assert queued_messages(redis_client, settings, model) == []    # it did nothing meanwhile
    assert reaper.reap().ran
    assert queued_messages(redis_client, settings, model) == [job_id]


def test_priorities_sharing_the_last_queue_step_are_counted_together(make_job, reaper, redis_client, settings,
                                                                     model, db_sessionmaker, celery):
    """A batch line's own priority moves it past the queue's last step (rein.core.priorities):
    jobs of priorities 9 and 12 wait on the same list, so the messages there stand for both."""
    from rein.core.priorities import LAST_QUEUE_STEP
    from rein.jobs.queues import enqueue_job, priority_lists
    from rein.store.messages import JobMessage

    lost = make_job(sent_ago=60, priority=LAST_QUEUE_STEP)
    waiting = make_job(sent_ago=30, priority=LAST_QUEUE_STEP + 3)
    with db_sessionmaker() as session:
        enqueue_job(celery, JobMessage.for_job(session.get(Job, waiting)))
    reaper.reap()
    # The one message on the step-9 list is the job sent last; the one sent before it lost its.
    last_step = priority_lists(settings, model, LAST_QUEUE_STEP, shard=0)[0]
    assert sorted(queued_job_ids(redis_client, last_step)) == sorted([lost, waiting])
    reaper.reap()    # both accounted for now: nothing more is sent
    assert len(queued_job_ids(redis_client, last_step)) == 2
