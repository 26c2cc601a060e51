"""Writing a finished job to Postgres: result, status and timings, usage — one transaction.

`record_job` is idempotent: the job row is updated only while it is `running` under the
recording attempt (the claim's lease), and the result and usage rows are inserted with
ON CONFLICT DO NOTHING on their job id. Calling it twice, or from a worker whose lease
was taken over, writes nothing more and never bills twice.

What is stored, and how the API gets the response body back from it: `results` holds the
engine's output (text, token ids, the engine's finish reason stop | length | abort) and,
when the request asked for logprobs, the response's `logprobs` object already in OpenAI's
shape (it needs the tokenizer, which the worker has and the API need not load).
`response_body(job, result)` rebuilds exactly the body the synchronous endpoint returns.

Postgres text and jsonb cannot hold U+0000, which a model can emit (a byte-level token
for 0x00): `storable_text` drops it, here and in the published events alike, so the
streamed deltas still concatenate to the stored text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from rein.core.models import Job, Result, Usage
from rein.openai_format import build_response
from rein.worker.claim import Lease


def storable_text(text: str) -> str:
    """`text` without U+0000 (Postgres refuses it in text and jsonb)."""
    return text.replace("\x00", "") if "\x00" in text else text


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


@dataclass
class JobRecord:
    """How an attempt ended, as the recorder writes it."""

    status: str                                   # succeeded | failed | cancelled
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None              # None: no result row (nothing ran)
    logprobs: dict[str, Any] | None = None        # the response's logprobs object
    prompt_tokens: int | None = None              # None: no usage row (the engine never had it)
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: datetime | None = None
    error: dict[str, Any] | None = None           # {"message", "type", "code"} when failed

    def __post_init__(self) -> None:
        if self.status not in ("succeeded", "failed", "cancelled"):
            raise ValueError(f"a job ends succeeded, failed or cancelled, not {self.status!r}")
        self.text = storable_text(self.text)
        self.logprobs = _storable(self.logprobs)
        self.error = _storable(self.error)


def record_job(sessions: sessionmaker[Session], lease: Lease, record: JobRecord) -> bool:
    """Write the attempt's outcome; False (and nothing written) if the lease is no longer held."""
    with sessions.begin() as session:
        row = session.execute(
            update(Job)
            .where(Job.id == lease.job_id, Job.attempt == lease.attempt, Job.status == "running")
            .values(status=record.status, finished_at=func.now(), first_token_at=record.first_token_at,
                    error=record.error, lease_expires_at=None)
            .returning(Job.tenant, Job.key_id, Job.model)
            .execution_options(synchronize_session=False)
        ).one_or_none()
        if row is None:
            return False
        if record.finish_reason is not None:
            session.execute(insert(Result).values(
                job_id=lease.job_id, text=record.text, finish_reason=record.finish_reason,
                token_ids=list(record.token_ids), logprobs=record.logprobs,
            ).on_conflict_do_nothing(index_elements=[Result.job_id]))
        if record.prompt_tokens is not None:
            session.execute(insert(Usage).values(
                job_id=lease.job_id, tenant=row.tenant, key_id=row.key_id, model=row.model,
                prompt_tokens=record.prompt_tokens, completion_tokens=record.completion_tokens,
                cached_tokens=min(record.cached_tokens, record.prompt_tokens),
            ).on_conflict_do_nothing(index_elements=[Usage.job_id]))
    return True


def response_body(job: Job, result: Result) -> dict[str, Any]:
    """The OpenAI body of a finished job, exactly as the synchronous endpoint returns it.

    `created` is the job's finish time; the id is the job id with OpenAI's prefix.
    """
    finished = job.finished_at or result.created_at
    body = build_response(job.endpoint, job.id, job.model, job.prompt_tokens, result.text,
                          list(result.token_ids), result.finish_reason, None, None, None,
                          created=int(finished.timestamp()) if finished is not None else None)
    body["choices"][0]["logprobs"] = result.logprobs
    return body


def response_logprobs(endpoint: str, logprobs: list[Any] | None, tokenizer: Any,
                      logprobs_mode: int | None) -> dict[str, Any] | None:
    """The response's `logprobs` object for the engine's per-token logprobs (None if not asked)."""
    if logprobs_mode is None or logprobs is None:
        return None
    token_ids = [lp.token_id for lp in logprobs]
    body = build_response(endpoint, "", "", 0, "", token_ids, None, logprobs, tokenizer, logprobs_mode,
                          created=0)
    return body["choices"][0]["logprobs"]
