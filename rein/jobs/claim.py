"""The job lease: which worker runs a job, under which attempt number.

A message may be delivered more than once (a worker was lost, a broker connection
dropped, a shutdown handed the job back), so the task never trusts the message: it
first claims the job row in Postgres with one conditional UPDATE.

Lease semantics:

* `claim_job` moves a job to `running`, increments `attempt`, records the worker and sets
  `lease_expires_at` = now + `Settings.lease_seconds` (30 s by default). It succeeds only
  when the job is `queued`, or `running` under an expired lease (its worker died without
  handing it back), and no cancel was requested.
* The lease is short and renewed: the worker renews the leases of all the jobs it runs in
  one statement every `Settings.lease_renew_seconds` (`renew_leases`). A worker that is
  killed, hangs or loses Postgres stops renewing, and within a lease its jobs are taken
  back by the reaper (rein.jobs.reaper) and queued again. The job time limit is separate:
  the worker that runs the job enforces it.
* Every later write names the attempt it belongs to (`WHERE attempt = :attempt AND
  status = 'running'`): a worker that lost its lease writes nothing, so one attempt at
  most ever records a result or bills usage.
* A job already finished (succeeded, failed, cancelled) is never claimed again: a
  redelivered message for it is acknowledged and does nothing. A job running under a live
  lease (another worker has it) is left alone too: that worker records it. So the broker's
  late redelivery of a dead worker's messages, and the duplicates the reaper may send,
  are harmless.
* A job whose attempts keep ending without a result (its workers lost, or a failure that
  kills the task) is not tried for ever: after MAX_ATTEMPTS starts the next claim (or the
  reaper) marks it failed (code `too_many_attempts`). Attempts the infrastructure spent
  are refunded (`attempts_refunded`): an attempt handed back because the worker's engine
  died, the worker shut down, or Redis or Postgres went away does not count, up to
  MAX_STARTS starts in all.
* A job running when its worker's engine died is a suspect: `release_job` hands it back with
  `deaths_seen` + 1 and the suspect group the worker put it in (`suspect_group`, of
  `suspect_group_size` jobs), which its next claim reads into the lease. The jobs present at
  a death are split in halves, a suspect shares its engine only with jobs that are no suspects
  and with its own group, and a job is failed as the cause (code `crashes_its_worker`) only
  once it died alone in its engine after an earlier death (rein.worker.suspects). A worker
  that vanished whole (its leases expired: a claim or the reaper takes the job back, the
  attempt refunded) is no evidence against its jobs: no death is counted and their groups
  stay as they were.
* The worker claims through `GroupClaimer`: jobs whose messages arrive together are claimed
  by one statement (`claim_jobs`), under the same conditions, each caller told its own
  outcome (rein.jobs.group_commit).
* `release_job` hands a job back (`queued`, the attempt refunded) when its run was
  interrupted rather than finished (warm shutdown, broker connection lost, engine died); the
  next claim runs it again as a new attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from rein.jobs.group_commit import GroupCommit
from rein.store.db import HeldConnections, engine_of, execute_all, execute_one
from rein.store.tables import FINISHED_JOB_STATUSES, Job

MAX_ATTEMPTS = 3          # attempts a job may spend (refunded ones not counted)
MAX_STARTS = 20           # claims in all, refunded or not: a bound for a job that is always handed back
# The attempts a job has spent, in SQL: refunded ones do not count.
SPENT_SQL = "(attempt - attempts_refunded)"


class ClaimOutcome(StrEnum):
    CLAIMED = "claimed"
    MISSING = "missing"                  # no such job row
    FINISHED = "finished"                # succeeded, failed or cancelled already: nothing to do
    CANCELLED = "cancelled"              # a cancel was requested; this call marked it cancelled
    HELD_ELSEWHERE = "held_elsewhere"    # running under another live lease
    GAVE_UP = "gave_up"                  # MAX_ATTEMPTS starts already: this call marked it failed


@dataclass(frozen=True)
class Lease:
    """A claimed job: what the later writes need to name it."""

    job_id: str
    attempt: int
    worker: str
    tenant: str
    key_id: str
    model: str
    endpoint: str
    prompt_tokens: int
    queue_seconds: float | None = None   # from the job's submission to this claim (database clock)
    deaths_seen: int = 0                 # deaths of its engine the job was present at
    batch_id: str | None = None          # the batch of a batch line
    suspect_group: str | None = None     # its suspect group after its last engine death (None: no suspect)
    suspect_group_size: int | None = None   # how many jobs that group had (1: the job runs alone)


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    lease: Lease | None = None

    @property
    def claimed(self) -> bool:
        return self.lease is not None


# A job that may start a new attempt: queued, or running under an expired lease. One
# condition for every path: the claim below, giving up, cancelling an unstarted job.
_CLAIMABLE_SQL = ("(status = 'queued' OR (status = 'running' "
                  "AND (lease_expires_at IS NULL OR lease_expires_at < now())))")


def _claimable():
    return text(_CLAIMABLE_SQL)


# A claimable `running` row is one whose lease expired: its worker died. Whoever takes it
# first, the reaper (rein.jobs.reaper) or a claim, refunds that attempt; no death is counted (a
# worker gone whole is no evidence against the jobs it held).
_LEASE_DIED_SQL = "CASE WHEN status = 'running' THEN 1 ELSE 0 END"
# Attempts left, counting the expired attempt as refunded.
_ATTEMPTS_LEFT_SQL = f"{SPENT_SQL} - {_LEASE_DIED_SQL} < %s AND attempt < {MAX_STARTS}"
_CLAIM_SET_SQL = f"""status = 'running', attempt = attempt + 1, worker = %s, started_at = now(),
       first_token_at = NULL, finished_at = NULL, error = NULL,
       attempts_refunded = attempts_refunded + {_LEASE_DIED_SQL},
       lease_expires_at = now() + make_interval(secs => %s)"""

# The claim: one conditional UPDATE, its own transaction (rein.store.db.execute_one; every job
# runs it, so it is SQL text), for a claimable job with no cancel requested and attempts left.
_CLAIM_SQL = f"""
UPDATE jobs SET {_CLAIM_SET_SQL}
 WHERE id = %s AND cancel_requested_at IS NULL AND {_ATTEMPTS_LEFT_SQL} AND {_CLAIMABLE_SQL}
RETURNING attempt, tenant, key_id, model, endpoint, prompt_tokens, queued_at, started_at, deaths_seen, batch_id,
          suspect_group, suspect_group_size"""


# claim_jobs: the same claim for several jobs in one statement. The rows are locked in id
# order first, so two workers claiming overlapping groups (duplicate messages) cannot deadlock.
# (`target` has only `id`: the other column names below are the jobs row's.)
_CLAIM_MANY_SQL = f"""
WITH target AS (
    SELECT id FROM jobs
     WHERE id = ANY(%s) AND cancel_requested_at IS NULL AND {_ATTEMPTS_LEFT_SQL} AND {_CLAIMABLE_SQL}
     ORDER BY id FOR UPDATE
)
UPDATE jobs SET {_CLAIM_SET_SQL}
  FROM target
 WHERE jobs.id = target.id AND cancel_requested_at IS NULL AND {_ATTEMPTS_LEFT_SQL} AND {_CLAIMABLE_SQL}
RETURNING jobs.id, jobs.attempt, jobs.tenant, jobs.key_id, jobs.model, jobs.endpoint, jobs.prompt_tokens,
          jobs.queued_at, jobs.started_at, jobs.deaths_seen, jobs.batch_id, jobs.suspect_group,
          jobs.suspect_group_size"""


def claim_job(sessions: sessionmaker[Session], job_id: str, worker: str, lease_for_seconds: float,
              max_attempts: int = MAX_ATTEMPTS, *, db: HeldConnections | None = None) -> Claim:
    """Take the job for a new attempt, or say why not (see the module docstring). `db`: a
    held connection for the claim's statement (else one from the pool)."""
    params = (worker, lease_for_seconds, job_id, max_attempts)
    row = (db.execute_one(_CLAIM_SQL, params) if db is not None
           else execute_one(engine_of(sessions), _CLAIM_SQL, params))
    if row is not None:
        return Claim(ClaimOutcome.CLAIMED, _lease(job_id, worker, row))
    return not_claimed(sessions, job_id, max_attempts)


def claim_jobs(sessions: sessionmaker[Session], job_ids: list[str], worker: str, lease_for_seconds: float,
               max_attempts: int = MAX_ATTEMPTS, *, db: HeldConnections | None = None) -> list[Claim | Exception]:
    """`claim_job` for several distinct jobs: one statement claims every claimable one; each of
    the others is told why not as claim_job would (a statement of its own: the rare case).
    Once the claims are committed, a failure to tell one of the others why is that job's
    alone: in its place in the answer, the exception."""
    params = (job_ids, max_attempts, worker, lease_for_seconds, max_attempts)
    rows = (db.execute_all(_CLAIM_MANY_SQL, params) if db is not None
            else execute_all(engine_of(sessions), _CLAIM_MANY_SQL, params))
    claimed = {row.id: row for row in rows}
    answers: list[Claim | Exception] = []
    for job_id in job_ids:
        if job_id in claimed:
            answers.append(Claim(ClaimOutcome.CLAIMED, _lease(job_id, worker, claimed[job_id])))
            continue
        try:
            answers.append(not_claimed(sessions, job_id, max_attempts))
        except Exception as exc:   # noqa: BLE001 - raised to that job's caller (rein.jobs.group_commit)
            answers.append(exc)
    return answers


class GroupClaimer(GroupCommit[str, Claim]):
    """`claim_job` shared by a worker's task threads, with group commit (rein.jobs.group_commit):
    jobs whose messages arrive together (a batch's lines) are claimed by one statement."""

    def __init__(self, sessions: sessionmaker[Session], worker: str, lease_for_seconds: float,
                 max_group: int = 64) -> None:
        # The writers take turns: one held connection serves them all (no checkout, no pre-ping).
        db = HeldConnections(engine_of(sessions), shared=True)
        super().__init__(write_many=lambda ids: claim_jobs(sessions, ids, worker, lease_for_seconds, db=db),
                         write_one=lambda job_id: claim_job(sessions, job_id, worker, lease_for_seconds, db=db),
                         key=lambda job_id: job_id, max_group=max_group, what="job claims")

    def claim(self, job_id: str) -> Claim:
        return self.call(job_id)


def _lease(job_id: str, worker: str, row: Any) -> Lease:
    queue_seconds = (row.started_at - row.queued_at).total_seconds() if row.queued_at else None
    return Lease(job_id, row.attempt, worker, row.tenant, row.key_id, row.model, row.endpoint, row.prompt_tokens,
                 queue_seconds, row.deaths_seen, row.batch_id, row.suspect_group, row.suspect_group_size)


def not_claimed(sessions: sessionmaker[Session], job_id: str, max_attempts: int = MAX_ATTEMPTS) -> Claim:
    """Why a job the claim did not take is not claimable (and, for a cancel or too many
    attempts, settle it)."""
    with sessions() as session:
        current = session.execute(
            select(Job.status, Job.cancel_requested_at, Job.attempt, Job.attempts_refunded)
            .where(Job.id == job_id)).one_or_none()
    if current is None:
        return Claim(ClaimOutcome.MISSING)
    if current.status in FINISHED_JOB_STATUSES:
        return Claim(ClaimOutcome.FINISHED)
    if current.cancel_requested_at is not None and cancel_unstarted_job(sessions, job_id):
        return Claim(ClaimOutcome.CANCELLED)
    # A running row here has an expired lease (or another live one): its attempt counts as refunded.
    spent = current.attempt - current.attempts_refunded - (current.status == "running")
    if (spent >= max_attempts or current.attempt >= MAX_STARTS) and _give_up(sessions, job_id, current.attempt):
        return Claim(ClaimOutcome.GAVE_UP)
    return Claim(ClaimOutcome.HELD_ELSEWHERE)


def too_many_attempts_error(attempts: int) -> dict[str, str]:
    return {"message": f"the job was started {attempts} times and never finished (its workers were lost "
                       f"or failed); it will not be tried again", "type": "server_error",
            "code": "too_many_attempts"}


def _give_up(sessions: sessionmaker[Session], job_id: str, attempts: int) -> bool:
    error = too_many_attempts_error(attempts)
    with sessions.begin() as session:
        row = session.execute(
            update(Job)
            .where(Job.id == job_id, _claimable())
            .values(status="failed", finished_at=func.now(), lease_expires_at=None, error=error)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        ).one_or_none()
    return row is not None


def cancel_unstarted_job(sessions: sessionmaker[Session], job_id: str) -> bool:
    """Mark a job that no live worker runs as cancelled; True when this call did it.

    For a job cancelled while queued (its message is skipped when taken) and for one whose
    worker died after a cancel was requested.
    """
    with sessions.begin() as session:
        row = session.execute(
            update(Job)
            .where(Job.id == job_id, _claimable())
            .values(status="cancelled", finished_at=func.now(), lease_expires_at=None,
                    cancel_requested_at=func.coalesce(Job.cancel_requested_at, func.now()))
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        ).one_or_none()
    return row is not None


def release_job(sessions: sessionmaker[Session], lease: Lease, *,
                suspect: tuple[str, int] | None = None) -> bool:
    """Hand an interrupted attempt back (status queued, about to be sent again: `sent_at` is
    now), the attempt refunded. `suspect`: it was running when its engine died, and is now a
    suspect of this (group, group size) (see the module docstring). False when the lease was
    already lost."""
    died = {} if suspect is None else {"deaths_seen": Job.deaths_seen + 1, "suspect_group": suspect[0],
                                       "suspect_group_size": suspect[1]}
    with sessions.begin() as session:
        row = session.execute(
            update(Job)
            .where(Job.id == lease.job_id, Job.attempt == lease.attempt, Job.status == "running")
            .values(status="queued", worker=None, lease_expires_at=None, started_at=None,
                    first_token_at=None, sent_at=func.now(), attempts_refunded=Job.attempts_refunded + 1,
                    **died)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        ).one_or_none()
    return row is not None


# Renewal: every lease this worker holds, in one statement; the (id, attempt) pairs it renewed.
_RENEW_SQL = """
UPDATE jobs SET lease_expires_at = now() + make_interval(secs => %s)
  FROM unnest(%s::text[], %s::integer[]) AS held(id, attempt)
 WHERE jobs.id = held.id AND jobs.attempt = held.attempt AND jobs.status = 'running'
   AND jobs.worker = %s
RETURNING jobs.id, jobs.attempt"""


def renew_leases(sessions: sessionmaker[Session], worker: str, leases: list[Lease],
                 lease_for_seconds: float) -> set[tuple[str, int]]:
    """Extend the leases of the jobs this worker runs; the (job id, attempt) pairs still held.

    A lease missing from the answer was lost (it expired and the reaper gave the job to
    another attempt, or the job ended): the worker should stop computing it.
    """
    if not leases:
        return set()
    rows = execute_all(engine_of(sessions), _RENEW_SQL, (
        lease_for_seconds, [lease.job_id for lease in leases], [lease.attempt for lease in leases], worker))
    return {(row.id, row.attempt) for row in rows}
