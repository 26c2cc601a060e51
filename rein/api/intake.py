"""Intake: how a job enters the system — validate, admit, store, enqueue — for the OpenAI
endpoints and POST /v1/jobs alike.

1. `JobIntake.validate` (per request): resolve the model (404 model_not_found), tokenize
   and validate the body with the model's tokenizer and chat template (400). An
   `Idempotency-Key` seen before for the tenant returns that job instead, without counting
   it again (409 `idempotency_key_reused` when it was a different request).
2. `JobIntake.commit` (for several submissions at once): admit them in one Redis round trip
   (503 when the model's queue is full, before anything is counted; 429 when the tenant
   holds its share of that queue, or over the key's limits; rein.jobs.ratelimit), INSERT the admitted ones as queued in one multi-row
   autocommitted statement, then publish their Celery messages in one Redis pipeline
   (kombu's `Producer.batch`). A job whose message could not be published is marked
   failed, so no worker runs it, and its request gets a 503.

Group commit: `JobIntake.submit` hands each validated submission to the process's
group commit (rein.jobs.group_commit, its own thread: the event loop must not block), which
takes every submission waiting, commits them together and answers each request. A request that finds the committer idle is committed at once; under
load, the requests that arrive while a commit is in flight go together in the next one.
The three round trips and their fixed costs (the Lua call, the INSERT, kombu's pipeline)
are then paid once per group rather than once per job, and intake no longer needs a thread
per request contending for the GIL (bench/intake.py measures it). The committer keeps its
Postgres connection between groups (rein.store.db.HeldConnections) instead of checking one
out of the pool, with its pre-ping, for each.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from typing import Any

from celery import Celery
from fastapi.concurrency import run_in_threadpool
from redis.exceptions import RedisError
from sqlalchemy import func, update
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from rein.api.jobs import check_metadata, find_job_by_idempotency_key, same_request_or_conflict
from rein.core.priorities import PRIORITY_BATCH
from rein.core.settings import Settings
from rein.jobs.affinity import shard_of_prefix
from rein.jobs.errors import APIError
from rein.jobs.group_commit import GroupCommit
from rein.jobs.image_sources import ImageSources, store_images
from rein.jobs.prepare import Prepared, prepare
from rein.jobs.queues import enqueue_jobs, queue_keys
from rein.jobs.ratelimit import (
    Admission,
    QueueFull,
    RateLimiter,
    RateLimitExceeded,
    RateLimitState,
    TenantQueueFull,
    settle_tokens,
)
from rein.jobs.registry import ModelRegistry
from rein.openai.embeddings import ParsedEmbeddings
from rein.openai.images import may_hold_images, without_image_data
from rein.openai.structured_fields import BODY_FIELDS as STRUCTURED_BODY_FIELDS
from rein.store.db import HeldConnections, engine_of
from rein.store.filestore import FileStore, filestore_for
from rein.store.keys import KeyInfo
from rein.store.messages import JobMessage
from rein.store.tables import Job, new_job_id

log = logging.getLogger(__name__)

BACKPRESSURE_RETRY_AFTER = 5
MAX_IDEMPOTENCY_KEY_LEN = 255
# The most submissions one commit takes: bounds one INSERT (11 parameters a row) and how
# long the requests at the end of a group wait for the ones before them.
MAX_GROUP = 256
# Bodies up to this size are tokenized on the event loop (well under a millisecond for
# them); a larger one goes to the thread pool, so one long prompt cannot stall the loop,
# and with it every other request of the process.
INLINE_VALIDATE_MAX_BYTES = 16 * 1024
# Bodies with a structured-output constraint (or tools, whose schemas are constraints) are
# validated in the thread pool whatever their size: a small schema can take seconds to
# compile (rein.engine.structured.validator waits for it, up to its deadline).
# (A /v1/responses body holds its format in `text`: rein.openai.responses.)
CONSTRAINT_FIELDS = frozenset({*STRUCTURED_BODY_FIELDS, "tools", "tool_choice", "text"})






@dataclass(slots=True)
class NewJob:
    """A job row being created: the columns intake writes, then those the database fills in.

    A plain record rather than a `Job`: intake never needs the ORM's change tracking, and
    building an instrumented object cost more than the rest of a request's bookkeeping.
    It reads like a `Job` where the routes use it (id, status, model, sizes).
    """

    id: str
    tenant: str
    key_id: str
    model: str
    endpoint: str
    params: dict[str, Any]
    prompt_token_ids: list[int]
    prompt_tokens: int
    priority: int
    idempotency_key: str | None
    metadata_: dict[str, str]
    shard: int = 0
    """The batch queue shard its message goes to (rein.jobs.affinity); 0 below batch priority."""
    status: str | None = None
    attempt: int | None = None
    created_at: datetime | None = None
    queued_at: datetime | None = None
    rate_limit: RateLimitState | None = None
    """The key's rate-limit counters after this job was admitted (the x-ratelimit-* headers)."""


@dataclass
class Submission:
    """A validated request, ready to commit: its job row (not yet stored) and its message."""

    key: KeyInfo
    prepared: Prepared
    job: NewJob
    message: JobMessage
    metadata: dict[str, str] | None


# What a request gets: (its job, what was prepared for it) — prepared is None when an
# earlier job (a `Job` from Postgres) was returned for its Idempotency-Key.
Accepted = tuple[NewJob | Job, Prepared | None]


class JobIntake:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session], celery: Celery,
                 limiter: RateLimiter, registry: ModelRegistry, filestore: FileStore | None = None) -> None:
        self.settings = settings
        # A request's images (a vision model's): resolved and opened while it is validated, then
        # kept in the file store, shared with the workers (rein.jobs.image_sources).
        self.filestore = filestore if filestore is not None else filestore_for(settings)
        self.images = ImageSources(settings, self.filestore, sessions)
        self.sessions = sessions
        self.celery = celery
        self.limiter = limiter
        self.registry = registry
        self._queue_keys: dict[str, tuple[str, ...]] = {}
        # The committer's own connection, kept between groups (rein.store.db.HeldConnections).
        self._db = HeldConnections(engine_of(sessions))
        self._committer: GroupCommit[Submission, Accepted] | None = None

    def start(self) -> JobIntake:
        # No write_one: `commit` already answers each submission on its own (a refusal, a row
        # Postgres refuses); when it raises, nothing was stored and every request gets the error.
        self._committer = GroupCommit(self.commit, max_group=MAX_GROUP, what="job submissions",
                                      thread_name="rein-intake-commit").start()
        return self

    def stop(self) -> None:
        if self._committer is not None:
            self._committer.stop()
        self._db.close()

    async def submit(self, key: KeyInfo, endpoint: str, body: dict[str, Any], *,
                     metadata: dict[str, str] | None = None, idempotency_key: str | None = None,
                     body_bytes: int | None = None) -> Accepted:
        """Validate, then commit with whatever other requests are waiting (see the docstring).

        `body_bytes`: the request body's size; a small one is tokenized on the event loop,
        a large or unknown one in the thread pool. A request with an Idempotency-Key
        validates in the thread pool too: it reads Postgres.
        """
        if self._committer is None:
            raise RuntimeError("JobIntake.start() was not called")
        args = (key, endpoint, body, metadata, idempotency_key)
        if (idempotency_key is None and body_bytes is not None and body_bytes <= INLINE_VALIDATE_MAX_BYTES
                and not CONSTRAINT_FIELDS.intersection(body) and not may_hold_images(body)):
            checked = self.validate(*args)
        else:
            checked = await run_in_threadpool(self.validate, *args)
        if isinstance(checked, Job):
            return checked, None
        return await asyncio.wrap_future(self._committer.submit(checked))

    def validate(self, key: KeyInfo, endpoint: str, body: dict[str, Any], metadata: dict[str, str] | None,
                 idempotency_key: str | None) -> Submission | Job:
        """The request checked and tokenized, as a Submission; or the job its Idempotency-Key
        already names. Raises APIError / RequestError (400, 404, 409)."""
        if idempotency_key is not None:
            if not 0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY_LEN:
                raise APIError(400, f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_LEN} characters",
                               param="Idempotency-Key", code="invalid_value")
            with self.sessions() as session:
                existing = find_job_by_idempotency_key(session, key.tenant, idempotency_key)
                if existing is not None and self._expired(existing):
                    # Past REIN_IDEMPOTENCY_KEY_TTL_SECONDS the key is free again: the old job
                    # keeps its results but no longer answers for the key.
                    session.execute(update(Job).where(Job.id == existing.id).values(idempotency_key=None))
                    session.commit()
                    existing = None
            if existing is not None:
                return same_request_or_conflict(existing, endpoint, body, metadata)
        check_metadata(metadata)
        prepared = prepare(self.registry, endpoint, body, images=self.images.for_request(key.tenant))
        parsed = prepared.parsed
        model = prepared.entry.name
        # Shallow: the values are only serialized (asdict's deep copy was a measurable cost).
        sampling = {f.name: getattr(parsed.params, f.name) for f in dataclasses.fields(parsed.params)}
        prompt = list(parsed.prompt_token_ids)
        # (data-URL images kept out: they are in the file store, rein.openai.images.without_image_data)
        params = {"body": without_image_data(body), "sampling": sampling, "logprobs_mode": parsed.logprobs_mode,
                  "stream": parsed.stream}
        if prepared.tool_parser is not None:   # how its answer's tool calls are read (rein.openai.tool_call_parsers)
            params["tool_parser"] = prepared.tool_parser
        lora = prepared.lora
        if lora is not None:   # a LoRA adapter's job: on its base model's queue (rein.jobs.adapters)
            params["lora"] = lora
        shape = parsed.shape.to_dict()
        if shape is not None:   # n > 1, best_of, echo, prompt logprobs (rein.openai.response_shape); plain jobs store none
            params["shape"] = shape
        reasoning = getattr(parsed, "reasoning", None)
        if reasoning is not None:   # the thinking split out of its body (rein.openai.reasoning)
            params["reasoning"] = reasoning.to_dict()
        images = prepared.image_refs
        if images is not None:   # kept in the file store before the job exists (rein.jobs.image_sources)
            store_images(self.filestore, prepared.images, self.sessions)
            params["images"] = images
        # Its class and its own `priority` (rein.core.priorities): `service_tier: "flex"` runs it
        # at batch priority, where it waits on the batch shard of its prefix (rein.jobs.affinity).
        priority = prepared.priority
        shard = shard_of_prefix(prompt) if priority >= PRIORITY_BATCH and self.settings.batch_affinity else 0
        job = NewJob(id=new_job_id(), tenant=key.tenant, key_id=key.key_id, model=model, endpoint=endpoint,
                     params=params,
                     prompt_token_ids=prompt, prompt_tokens=len(prompt), priority=priority,
                     idempotency_key=idempotency_key, metadata_=dict(metadata or {}), shard=shard)
        message = JobMessage(job_id=job.id, model=prepared.entry.queue_model, endpoint=endpoint,
                             prompt_token_ids=prompt, sampling=sampling, priority=priority,
                             logprobs_mode=parsed.logprobs_mode, tenant=key.tenant, key_id=key.key_id,
                             shape=shape, shard=shard, lora=lora, reasoning=params.get("reasoning"),
                             images=images)
        if isinstance(parsed, ParsedEmbeddings):   # its inputs, one after the other in `prompt`
            job.params["input_lengths"] = message.input_lengths = parsed.input_lengths
        return Submission(key, prepared, job, message, metadata)

    def _expired(self, job: Job) -> bool:
        age = datetime.now(UTC) - job.created_at
        return age.total_seconds() > self.settings.idempotency_key_ttl_seconds

    def commit(self, submissions: Sequence[Submission]) -> list[Accepted | Exception]:
        """Admit, store and enqueue these submissions together; for each, in order, what its
        request gets: (job, prepared) or the APIError that refused it. Raises only when
        Redis or Postgres cannot be used at all (then none of them was stored)."""
        outcomes: list[Accepted | Exception | None] = [None] * len(submissions)
        queued = self._tenants_queued(submissions)
        estimate = self.settings.tpm_completion_estimate
        verdicts = self.limiter.admit(
            [Admission(s.key, s.prepared.charged_tokens(estimate), self._queue(s.message.model),
                       queued.get((s.message.model, s.key.tenant), 0) if queued is not None else None,
                       job_id=s.job.id)
             for s in submissions],
            max_depth=self.settings.max_queue_depth)
        admitted = [i for i, verdict in enumerate(verdicts) if verdict.refusal is None]
        for i, verdict in enumerate(verdicts):
            submissions[i].job.rate_limit = verdict.state
            if verdict.refusal is not None:
                outcomes[i] = _refused(submissions[i].job.model, verdict.refusal)
        stored, refused = self._insert_isolated([submissions[i].job for i in admitted])
        for i in admitted:
            if submissions[i].job.id in refused:
                outcomes[i] = refused[submissions[i].job.id]
            elif submissions[i].job.id not in stored:
                # Another request with the same Idempotency-Key won the race: answer with its job.
                outcomes[i] = self._existing_job(submissions[i])
        to_send = [i for i in admitted if submissions[i].job.id in stored]
        sent = self._publish([submissions[i] for i in to_send])
        for i in to_send:
            outcomes[i] = (submissions[i].job, submissions[i].prepared) if sent else APIError(
                503, "The job queue is unavailable; the job was not accepted. Retry later.",
                type="server_error", code="queue_unavailable",
                headers={"Retry-After": str(BACKPRESSURE_RETRY_AFTER)})
        # Admitted (and charged) but not run: not stored, another request's job returned, or
        # never queued. Their charges are given back.
        self._refund([submissions[i] for i in admitted if not sent or submissions[i].job.id not in stored])
        return outcomes  # type: ignore[return-value]  # every slot is filled above

    def _refund(self, submissions: Sequence[Submission]) -> None:
        for submission in submissions:
            if submission.job.rate_limit is None or submission.job.rate_limit.tpm is None:
                continue
            try:
                settle_tokens(self.limiter.redis, self.limiter.keys, submission.job.id, submission.key.key_id, 0)
            except RedisError as exc:   # the charge expires with its window
                log.warning("could not give back the token charge of job %s: %s", submission.job.id, exc)

    def _tenants_queued(self, submissions: Sequence[Submission]) -> dict[tuple[str, str], int] | None:
        """(model, tenant) -> the tenant's queued jobs on that model's queues (its LoRA adapters'
        included; batch lines aside: the batch manager shares their room), for the queue share
        check; None when it is off."""
        if self.limiter.tenant_queue_cap(self.settings.max_queue_depth) is None:
            return None
        models = sorted({s.message.model for s in submissions})    # the queues: adapters' base models
        tenants = sorted({s.key.tenant for s in submissions})
        rows = self._db.execute_all(_TENANTS_QUEUED_SQL, (tenants, models, models))
        return {(model, tenant): count for model, tenant, count in rows}

    def _queue(self, model: str) -> tuple[str, ...]:
        lists = self._queue_keys.get(model)
        if lists is None:
            lists = self._queue_keys[model] = tuple(queue_keys(self.settings, model))
        return lists

    def _insert_isolated(self, jobs: list[NewJob]) -> tuple[set[str], dict[str, APIError]]:
        """`_insert`, where a row Postgres refuses fails its own request only: when the group's
        INSERT is refused, each row is inserted on its own. Ids stored, and the refusals.

        Intake validates what a row may hold before grouping; this is the net under it, so
        one tenant's odd request can never fail another's. An outage (OperationalError,
        InterfaceError) is not a refusal: it fails the whole group (503)."""
        try:
            return self._insert(jobs), {}
        except (OperationalError, InterfaceError):
            raise
        except DBAPIError as exc:
            if len(jobs) == 1:
                return set(), {jobs[0].id: _unstorable(exc)}
            log.warning("a group of %d jobs was refused by Postgres (%s); storing them one by one",
                        len(jobs), type(exc.orig).__name__)
        stored: set[str] = set()
        refused: dict[str, APIError] = {}
        for job in jobs:
            one_stored, one_refused = self._insert_isolated([job])
            stored |= one_stored
            refused |= one_refused
        return stored, refused

    def _insert(self, jobs: list[NewJob]) -> set[str]:
        """INSERT the job rows in one autocommitted statement; the ids stored (a row whose
        Idempotency-Key is taken is skipped). Fills in the columns the database sets."""
        if not jobs:
            return set()
        values: list[Any] = []
        for job in jobs:
            values += (job.id, job.tenant, job.key_id, job.model, job.endpoint, json.dumps(job.params),
                       "{" + ",".join(map(str, job.prompt_token_ids)) + "}", job.prompt_tokens,
                       job.priority, job.idempotency_key, json.dumps(job.metadata_), job.shard)
        by_id = {job.id: job for job in jobs}
        stored = set()
        rows = self._db.execute_all(_insert_sql(len(jobs)), tuple(values))
        for job_id, status, attempt, created_at, queued_at in rows:
            job = by_id[job_id]
            job.status, job.attempt, job.created_at, job.queued_at = status, attempt, created_at, queued_at
            stored.add(job_id)
        return stored

    def _existing_job(self, submission: Submission) -> Accepted | Exception:
        with self.sessions() as session:
            existing = find_job_by_idempotency_key(session, submission.key.tenant,
                                                   submission.job.idempotency_key or "")
        if existing is None:
            return RuntimeError(f"job insert for tenant {submission.key.tenant} conflicted with no job")
        try:
            return same_request_or_conflict(existing, submission.job.endpoint, submission.prepared.body,
                                            submission.metadata), None
        except APIError as exc:
            return exc

    def _publish(self, submissions: list[Submission]) -> bool:
        """Publish their messages in one pipeline; on failure mark their jobs failed (a
        worker skips a failed job, should a message have gone out after all) and say False."""
        if not submissions:
            return True
        try:
            enqueue_jobs(self.celery, [s.message for s in submissions])
            return True
        except Exception as exc:  # kombu raises transport-specific errors
            ids = [s.job.id for s in submissions]
            log.error("could not enqueue %d job(s) (%s): %s", len(ids), ", ".join(ids), exc)
            with self.sessions.begin() as session:
                session.execute(update(Job).where(Job.id.in_(ids), Job.status == "queued")
                                .values(status="failed", finished_at=func.now(),
                                        error={"message": f"could not be queued: {exc}",
                                               "type": "server_error", "code": "queue_unavailable"}))
            return False


def _unstorable(exc: DBAPIError) -> APIError:
    """A 400 for a request whose row Postgres refused (its own first line: no parameters)."""
    reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else type(exc).__name__
    return APIError(400, f"The request holds a value that cannot be stored ({reason}); check its token ids, "
                         f"strings and numbers.", code="invalid_value")


def _refused(model: str, refusal: QueueFull | TenantQueueFull | RateLimitExceeded) -> APIError:
    if isinstance(refusal, TenantQueueFull):
        return APIError(429, f"Your organization has {refusal.queued} requests queued for model '{model}', its "
                             f"share of the queue ({refusal.limit}, REIN_TENANT_QUEUE_SHARE of "
                             f"REIN_MAX_QUEUE_DEPTH). Retry once some have run.", type="requests",
                        code="tenant_queue_full", headers={"Retry-After": str(BACKPRESSURE_RETRY_AFTER)})
    if isinstance(refusal, QueueFull):
        return APIError(503, f"The queue of model '{model}' is full ({refusal.depth} jobs waiting, limit "
                             f"{refusal.limit}). Retry later.", type="server_error", code="queue_full",
                        headers={"Retry-After": str(BACKPRESSURE_RETRY_AFTER)})
    return APIError(429, refusal.message, type=refusal.kind, code="rate_limit_exceeded",
                    headers=refusal.headers())


# A tenant's queued interactive jobs per model (the partial index on queued jobs by model).
# By the queue a job waits on: a LoRA adapter's jobs (params.lora) wait on their base model's.
_TENANTS_QUEUED_SQL = """
SELECT COALESCE(params->'lora'->>'base', model) AS queue_model, tenant, count(*) FROM jobs
 WHERE status = 'queued' AND batch_id IS NULL AND tenant = ANY(%s)
   AND (model = ANY(%s) OR params->'lora'->>'base' = ANY(%s))
 GROUP BY queue_model, tenant"""


# The INSERT as SQL text (see rein.store.db.execute_all: building and compiling it with
# SQLAlchemy per call cost more CPU than the rest of the write). The columns are checked
# against the mapped table, so it cannot drift from the schema; the database fills in the
# rest (status, times).
_INSERT_COLUMNS = ("id", "tenant", "key_id", "model", "endpoint", "params", "prompt_token_ids",
                   "prompt_tokens", "priority", "idempotency_key", "metadata", "shard")
_CASTS = {"params": "::jsonb", "prompt_token_ids": "::integer[]", "metadata": "::jsonb"}
if not set(_INSERT_COLUMNS) <= set(Job.__table__.c.keys()):
    raise RuntimeError(f"the intake INSERT names columns jobs lacks: {set(_INSERT_COLUMNS) - set(Job.__table__.c.keys())}")
# sent_at: the message is published right after the INSERT (the reaper sends it again if it
# never reaches the queue, see rein.jobs.reaper).
_INSERT_ROW = "(" + ", ".join("%s" + _CASTS.get(c, "") for c in _INSERT_COLUMNS) + ", now())"


@lru_cache(maxsize=MAX_GROUP)
def _insert_sql(rows: int) -> str:
    # ON CONFLICT DO NOTHING: a taken (tenant, Idempotency-Key) skips the row, also when two
    # rows of one group carry the same key.
    return (f"INSERT INTO {Job.__tablename__} ({', '.join(_INSERT_COLUMNS)}, sent_at) "
            f"VALUES {', '.join([_INSERT_ROW] * rows)} "
            "ON CONFLICT DO NOTHING RETURNING id, status, attempt, created_at, queued_at")
