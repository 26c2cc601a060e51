"""The Postgres schema as SQLAlchemy 2 typed ORM classes: api_keys, jobs, results, usage,
files, batches, lora_adapters and the webhooks' endpoints, events (an outbox) and attempts.

The schema only ever changes through a migration (migrations/versions/); a test checks that
these classes and the migrated database agree exactly.

Ids: a job id is `job_` + 32 hex digits (a random UUID), readable in URLs and logs and
unguessable. An API key's primary key is its key id, the public part of the key (see
rein.store.keys). Every row that a client can read carries `tenant`, and every read is
filtered by it. All timestamps are `timestamptz`, set by the database clock where a default
applies.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# Deterministic constraint names, so later migrations can refer to them.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED_JOB_STATUSES = ("succeeded", "failed", "cancelled")
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
FILE_PURPOSES = ("batch", "batch_output", "vision")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired",
                  "cancelling", "cancelled")
FINISHED_BATCH_STATUSES = ("failed", "completed", "expired", "cancelled")
WEBHOOK_EVENT_STATUSES = ("pending", "delivered", "failed")


def new_job_id() -> str:
    return f"job_{uuid.uuid4().hex}"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {
        datetime: DateTime(timezone=True),
        str: Text(),
        dict[str, Any]: JSONB(),
        list[int]: ARRAY(Integer()),
        list[str]: ARRAY(Text()),
    }


class ApiKey(Base):
    """An API key: its public id, a hash of its secret (never the secret), scopes and limits."""

    __tablename__ = "api_keys"

    key_id: Mapped[str] = mapped_column(primary_key=True)
    """The public id embedded in the key (rein_<key_id>_<secret>)."""
    name: Mapped[str]
    tenant: Mapped[str] = mapped_column(index=True)
    """Whose key this is; every object the key creates belongs to this tenant."""
    secret_hash: Mapped[bytes] = mapped_column(LargeBinary())
    """SHA-256 of the secret (see rein.store.keys for why a fast hash is right here)."""
    scopes: Mapped[list[str]]
    rpm_limit: Mapped[int | None]
    """Requests per minute; NULL: the settings' default_rpm."""
    tpm_limit: Mapped[int | None]
    """Tokens (prompt + max_tokens) per minute; NULL: the settings' default_tpm."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    revoked_at: Mapped[datetime | None]

    __table_args__ = (
        CheckConstraint("rpm_limit IS NULL OR rpm_limit > 0", name="rpm_limit_positive"),
        CheckConstraint("tpm_limit IS NULL OR tpm_limit > 0", name="tpm_limit_positive"),
    )


class Job(Base):
    """One inference request, sync or async, from intake to its end.

    `params` holds what the client sent (`body`) and the sampling parameters the API resolved
    (`sampling`). `prompt_token_ids` is the tokenized prompt: the queue message carries it too,
    but a redelivered message, a replay or an audit can rely on the row alone.

    Claiming: a worker moves a job queued -> running by incrementing `attempt` and setting
    `worker` and `lease_expires_at` in one conditional UPDATE; its later writes name the
    attempt they belong to, so a stale worker's writes match no row.
    """

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_job_id)
    tenant: Mapped[str]
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"), index=True)
    model: Mapped[str]
    endpoint: Mapped[str]
    """/v1/completions or /v1/chat/completions: the shape of the response body."""
    params: Mapped[dict[str, Any]]
    prompt_token_ids: Mapped[list[int]]
    prompt_tokens: Mapped[int]
    priority: Mapped[int] = mapped_column(server_default=text("0"))
    """The priority the job runs at (rein.core.priorities: its class's base plus the request's own
    `priority`; lower is taken first); the queue step is min(priority, 9)."""
    status: Mapped[str] = mapped_column(server_default=text("'queued'"))
    attempt: Mapped[int] = mapped_column(server_default=text("0"))
    """How many times a worker has claimed the job (the lease's fencing token: never goes down)."""
    attempts_refunded: Mapped[int] = mapped_column(server_default=text("0"))
    """Attempts handed back for the infrastructure's fault (the worker's engine died, a warm
    shutdown, Redis or Postgres away), which do not count against the job's limit."""
    deaths_seen: Mapped[int] = mapped_column(server_default=text("0"))
    """Deaths of its engine the job was running at (a worker that vanished whole counts none)."""
    suspect_group: Mapped[str | None]
    """After an engine death: the half of the jobs present this job is a suspect with; it shares
    an engine only with jobs that are no suspects and its own group (rein.worker.suspects)."""
    suspect_group_size: Mapped[int | None]
    """How many jobs that group had: 1, the job runs alone."""
    worker: Mapped[str | None]
    """The worker holding (or last holding) the job."""
    lease_expires_at: Mapped[datetime | None]
    idempotency_key: Mapped[str | None]
    """The client's Idempotency-Key; a retry with the same key gets this job back."""
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", server_default=text("'{}'::jsonb"))
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    queued_at: Mapped[datetime] = mapped_column(server_default=func.now())
    started_at: Mapped[datetime | None]
    first_token_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cancel_requested_at: Mapped[datetime | None]
    """Set by a cancel request; a worker that sees it aborts the job."""
    error: Mapped[dict[str, Any] | None]
    """On failure: {"message", "type", "code"} in OpenAI's error shape."""
    batch_id: Mapped[str | None] = mapped_column(ForeignKey("batches.id"))
    """The batch this job is one line of; NULL for jobs submitted on their own."""
    custom_id: Mapped[str | None]
    """The batch line's custom_id (unique within the batch)."""
    batch_line: Mapped[int | None]
    """The batch line's number in the input file (1-based), for output order and error reports."""
    feed_key: Mapped[bytes | None] = mapped_column(LargeBinary())
    """A batch line's prompt prefix as sortable bytes (rein.batches.batch_jobs.feed_key): the
    batch manager sends lines in this order, so those sharing a prefix run while it is cached."""
    sent_at: Mapped[datetime | None]
    """When the job's message was last put on its queue (by intake, the batch manager or the
    reaper); NULL: not sent yet (batch lines wait for the batch manager)."""
    requested_tokens: Mapped[int | None]
    shard: Mapped[int] = mapped_column(SmallInteger(), server_default=text("0"))
    """The batch queue shard the job's message goes to, by its prompt's prefix (rein.jobs.affinity):
    batch lines sharing a document wait on one shard, which one worker takes first; 0 for
    interactive jobs and with REIN_BATCH_AFFINITY off."""
    """A batch line's prompt + n x max_tokens (the most it may cost): what the per-tenant cap on
    queued batch tokens counts (REIN_MAX_QUEUED_BATCH_TOKENS_PER_TENANT); NULL for other jobs."""

    result: Mapped[Result | None] = relationship(back_populates="job")
    usage: Mapped[Usage | None] = relationship(back_populates="job")

    __table_args__ = (
        CheckConstraint(_in("status", JOB_STATUSES), name="status_valid"),
        CheckConstraint("attempt >= 0", name="attempt_nonnegative"),
        CheckConstraint("prompt_tokens >= 0", name="prompt_tokens_nonnegative"),
        UniqueConstraint("tenant", "idempotency_key"),
        # Listing newest first is a backward scan of this index.
        Index("ix_jobs_tenant_created_at", "tenant", "created_at", "id"),
        UniqueConstraint("batch_id", "custom_id"),
        # A batch's request_counts and the manager's "what is left" are GROUP BYs on this.
        Index("ix_jobs_batch_id_status", "batch_id", "status"),
        # The reaper's two questions (rein.jobs.reaper): which leases ran out, which queued
        # jobs were sent long ago; small partial indexes, since few jobs are open at a time.
        Index("ix_jobs_running_lease", "lease_expires_at", postgresql_where=text("status = 'running'")),
        Index("ix_jobs_queued_sent", "model", "priority", "sent_at", postgresql_where=text("status = 'queued'")),
        # The batch manager's next lines, better priority first, then in prefix order: only the
        # lines not sent yet.
        Index("ix_jobs_batch_unsent", "batch_id", "shard", "priority", "feed_key", "batch_line",
              postgresql_where=text("status = 'queued' AND sent_at IS NULL")),
        # The batch lines sent and not finished, per tenant: the queued batch token cap.
        Index("ix_jobs_batch_in_flight", "tenant",
              postgresql_where=text("batch_id IS NOT NULL AND sent_at IS NOT NULL "
                                    "AND status IN ('queued', 'running')")),
    )


# The columns a job's queue message is rebuilt from (rein.store.messages.JobMessage.for_job).
JOB_MESSAGE_COLUMNS = (Job.id, Job.model, Job.endpoint, Job.prompt_token_ids, Job.params, Job.priority,
                       Job.tenant, Job.key_id, Job.shard, Job.batch_id)


class Result(Base):
    """What a finished job produced (the engine's output, before response formatting)."""

    __tablename__ = "results"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    text: Mapped[str]
    finish_reason: Mapped[str]
    """stop | length | abort, as the engine reports it."""
    token_ids: Mapped[list[int]]
    logprobs: Mapped[dict[str, Any] | None]
    """Only when the request asked for logprobs, in the shape the response needs."""
    response: Mapped[dict[str, Any] | None]
    """Parts of the response body the worker built, merged over the plain one-choice body:
    `choices` (n > 1, echo, prompt logprobs, tool calls) or `data` (embeddings). NULL for a
    plain answer."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())

    job: Mapped[Job] = relationship(back_populates="result")

    # Retention's oldest results first (rein.jobs.retention).
    __table_args__ = (Index("ix_results_created_at", "created_at"),)


class Usage(Base):
    """Token accounting: exactly one row per job (unique on job_id), written with the result."""

    __tablename__ = "usage"

    id: Mapped[int] = mapped_column(BigInteger(), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), unique=True)
    tenant: Mapped[str]
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"))
    model: Mapped[str]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    cached_tokens: Mapped[int] = mapped_column(server_default=text("0"))
    """Prompt tokens served from the prefix cache (a subset of prompt_tokens)."""
    reasoning_tokens: Mapped[int] = mapped_column(server_default=text("0"))
    """Completion tokens of a reasoning model's thinking (rein.openai.reasoning; 0 without a parser)."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())

    job: Mapped[Job] = relationship(back_populates="usage")

    __table_args__ = (
        CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0 "
            "AND cached_tokens <= prompt_tokens",
            name="tokens_valid",
        ),
        Index("ix_usage_tenant_created_at", "tenant", "created_at"),
        Index("ix_usage_created_at", "created_at"),       # retention (rein.jobs.retention)
    )


class File(Base):
    """An uploaded or generated file: its metadata here, its bytes in the FileStore (by id)."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_file_id)
    tenant: Mapped[str]
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"))
    filename: Mapped[str]
    purpose: Mapped[str]
    """batch (uploaded input), batch_output (a batch's output or error file) or vision (an uploaded
    image, named by a request's `file_id`: rein.jobs.image_sources)."""
    bytes: Mapped[int] = mapped_column(BigInteger())
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    expires_at: Mapped[datetime | None]
    """When the expiry sweep deletes the file (rein.jobs.retention); None: kept until deleted."""

    __table_args__ = (
        CheckConstraint(_in("purpose", FILE_PURPOSES), name="purpose_valid"),
        CheckConstraint("bytes >= 0", name="bytes_nonnegative"),
        Index("ix_files_tenant_created_at", "tenant", "created_at", "id"),
        # The expiry sweep's files past their expires_at (rein.jobs.retention).
        Index("ix_files_expires_at", "expires_at", postgresql_where=text("expires_at IS NOT NULL")),
    )


class StoredImage(Base):
    """An image a request sent, kept in the file store as `image-<sha256>` until its jobs have run
    (rein.jobs.image_sources): one row per distinct image, whoever sent it. `last_used_at` is
    the last time a request named it; the retention sweep deletes an image unused for
    REIN_IMAGE_RETENTION_SECONDS that no queued or running job names (rein.jobs.retention)."""

    __tablename__ = "stored_images"

    sha256: Mapped[str] = mapped_column(primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger())
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    last_used_at: Mapped[datetime] = mapped_column(server_default=func.now())

    __table_args__ = (
        CheckConstraint("bytes >= 0", name="bytes_nonnegative"),
        Index("ix_stored_images_last_used_at", "last_used_at"),
    )


class Batch(Base):
    """An OpenAI batch: one input file, one job per line, output and error files at the end.

    `status` follows OpenAI's: validating -> in_progress -> finalizing -> completed, or failed
    (validation), expired, cancelling -> cancelled. Request counts are not stored: they are
    a GROUP BY over the batch's jobs when read. `errors` holds validation errors
    ({"code", "line", "message", "param"} each), as OpenAI's `errors.data`.
    """

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(primary_key=True, default=new_batch_id)
    tenant: Mapped[str]
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"))
    endpoint: Mapped[str]
    input_file_id: Mapped[str]
    """No foreign key: the input file may be deleted once its lines are jobs."""
    completion_window: Mapped[str]
    model: Mapped[str | None]
    """The model of every line, known after validation."""
    status: Mapped[str] = mapped_column(server_default=text("'validating'"))
    request_total: Mapped[int] = mapped_column(server_default=text("0"))
    validation_starts: Mapped[int] = mapped_column(server_default=text("0"))
    """Validations started and not ended by the process that ran them: each start adds one,
    committed before the file is read, and one that stops without a verdict (a shutdown, an
    outage) takes it back; what stays counts the processes that died validating the batch."""
    errors: Mapped[dict[str, Any] | None]
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", server_default=text("'{}'::jsonb"))
    output_file_id: Mapped[str | None]
    error_file_id: Mapped[str | None]
    output_expires_after_seconds: Mapped[int | None]
    """The output and error files expire this long after they are written (the batch's
    `output_expires_after`, else REIN_BATCH_FILE_EXPIRY_SECONDS); None: they are kept."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]

    __table_args__ = (
        CheckConstraint(_in("status", BATCH_STATUSES), name="status_valid"),
        CheckConstraint("request_total >= 0", name="request_total_nonnegative"),
        Index("ix_batches_tenant_created_at", "tenant", "created_at", "id"),
        # The manager's scan for batches with work to do.
        Index("ix_batches_status", "status"),
    )


class LoRAAdapter(Base):
    """A LoRA adapter registered for the whole fleet at run time (POST /v1/load_lora_adapter):
    its jobs go to `base_model`'s queue and any worker serving that model runs them, reading the
    adapter from `path`. Those named in REIN_LORA_MODULES are not stored: every process reads
    them from its settings. Unloading deletes the row."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(primary_key=True)
    """What requests pass as `model`."""
    base_model: Mapped[str]
    """The served model (a REIN_MODELS name) it runs over."""
    path: Mapped[str]
    """A PEFT adapter directory or a GGUF LoRA file every worker can read."""
    lora_int_id: Mapped[int] = mapped_column(BigInteger())
    """The engines' id of the adapter (rein.jobs.adapters.lora_int_id): one per name and path."""
    base_model_name: Mapped[str | None]
    """The base the adapter was checked against, passed on to the workers' own check."""
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"))
    """The admin key that registered it."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())


class WebhookEndpoint(Base):
    """A tenant's webhook endpoint (rein.batches.webhooks): where its batch events are POSTed and
    the secret they are signed with. One per tenant; setting it again replaces the URL and the
    secret (rotation)."""

    __tablename__ = "webhook_endpoints"

    tenant: Mapped[str] = mapped_column(primary_key=True)
    id: Mapped[str] = mapped_column(unique=True)
    """`whep_` + 32 hex digits, new at every set."""
    url: Mapped[str]
    event_types: Mapped[list[str]]
    """The event types delivered (a subset of rein.batches.webhooks.events.EVENT_TYPES)."""
    secret: Mapped[str]
    """The Standard Webhooks signing secret (`whsec_` + base64), stored as is so that it can sign;
    shown once, when set."""
    key_id: Mapped[str] = mapped_column(ForeignKey("api_keys.key_id"))
    """The admin key that set it."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(server_default=func.now())


class WebhookEvent(Base):
    """One event to deliver (the outbox): written in the transaction that moves its batch to a final
    status, delivered by rein.batches.webhooks.delivery. Its id is the `webhook-id` of every try.

    A deliverer claims a due row by moving `next_attempt_at` a lease ahead and counting the attempt
    (FOR UPDATE SKIP LOCKED, so any number of processes share the work); it records the outcome
    only while `attempts` is still the one it claimed."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(primary_key=True)
    """`evt_` + 32 hex digits: the event's `id` and the `webhook-id` header."""
    tenant: Mapped[str]
    type: Mapped[str]
    """batch.completed | batch.failed | batch.cancelled | batch.expired"""
    batch_id: Mapped[str]
    """The event's `data.id` (no foreign key: the event outlives nothing it needs from the row)."""
    created_at: Mapped[datetime] = mapped_column(server_default=func.now())
    """The event's `created_at`: when its batch reached the final status."""
    status: Mapped[str] = mapped_column(server_default=text("'pending'"))
    attempts: Mapped[int] = mapped_column(server_default=text("0"))
    next_attempt_at: Mapped[datetime] = mapped_column(server_default=func.now())
    """When a pending event is due (again); while a delivery is under way, when its lease ends."""
    delivered_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    last_error: Mapped[str | None]

    __table_args__ = (
        CheckConstraint(_in("status", WEBHOOK_EVENT_STATUSES), name="status_valid"),
        CheckConstraint("attempts >= 0", name="attempts_nonnegative"),
        Index("ix_webhook_events_tenant_created_at", "tenant", "created_at"),
        # The deliverers' question: which pending events are due.
        Index("ix_webhook_events_due", "next_attempt_at", postgresql_where=text("status = 'pending'")),
    )


class WebhookAttempt(Base):
    """One try at delivering an event: where, when, how long, and the answer or the error."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(BigInteger(), primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    attempt: Mapped[int]
    """1 for the first try."""
    url: Mapped[str]
    started_at: Mapped[datetime]
    duration_ms: Mapped[int]
    status_code: Mapped[int | None]
    """The receiver's HTTP status; NULL when none came (refused, timed out, destination refused)."""
    error: Mapped[str | None]
    """Why the try failed; NULL for a 2xx."""

    __table_args__ = (UniqueConstraint("event_id", "attempt"),)
