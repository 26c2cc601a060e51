"""Writing a finished job to Postgres: result, status and timings, usage — one transaction.

`record_job` is idempotent: the job row is updated only while it is `running` under the
recording attempt (the claim's lease), and the result and usage rows are inserted with
ON CONFLICT DO NOTHING on their job id. Calling it twice, or from a worker whose lease
was taken over, writes nothing more and never bills twice.

What is stored, and how the API gets the response body back from it: `results` holds the
engine's output (text, token ids, the engine's finish reason stop | length | abort) and,
when the request asked for logprobs, the response's `logprobs` object already in OpenAI's
shape (it needs the tokenizer, which the worker has and the API need not load).
`response_body(job, result)` rebuilds exactly the body the synchronous endpoint returns
(tool calls are parsed out of the stored text there, from the job's own request body).
A request with more than one plain choice (n > 1, best_of, echo, prompt logprobs) also
stores `results.response`: the body's `choices` and `usage` (rein.openai.choices_response), merged
over the plain body; its text, token ids and logprobs columns hold the first returned choice.

The worker records through `GroupRecorder`: jobs that end together (a batch's lines end
in the same engine steps) are written by one statement (`record_jobs`), with the same
conditions and the same idempotence per job, so one round trip and one commit for the group.
A group with batch lines in it is announced (`on_batch_lines`, rein.batches.wakeup), so the
batch managers feed and finish at once.

Postgres text and jsonb cannot hold U+0000, which a model can emit (a byte-level token
for 0x00): `storable_text` drops it, here and in the published events alike, so the
streamed deltas still concatenate to the stored text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from rein.jobs.claim import Lease
from rein.jobs.group_commit import GroupCommit
from rein.store.db import HeldConnections, engine_of, execute_all, execute_one


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
    reasoning_tokens: int = 0                     # of completion_tokens, a reasoning model's thinking
    first_token_at: datetime | None = None
    error: dict[str, Any] | None = None           # {"message", "type", "code"} when failed
    # Body parts beyond the plain one-choice answer (rein.openai.choices_response.response_extra, or an
    # embeddings job's `data`); None: plain.
    response: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.status not in ("succeeded", "failed", "cancelled"):
            raise ValueError(f"a job ends succeeded, failed or cancelled, not {self.status!r}")
        self.text = storable_text(self.text)
        self.logprobs = _storable(self.logprobs)
        self.error = _storable(self.error)
        self.response = _storable(self.response)


def record_job(sessions: sessionmaker[Session], lease: Lease, record: JobRecord, *,
               db: HeldConnections | None = None) -> bool:
    """Write the attempt's outcome; False (and nothing written) if the lease is no longer held.
    `db`: a held connection for the statement (else one from the pool)."""
    has_result = record.finish_reason is not None
    has_usage = record.prompt_tokens is not None
    prompt_tokens = record.prompt_tokens or 0
    run = db.execute_one if db is not None else partial(execute_one, engine_of(sessions))
    row = run(_RECORD_SQL, (
        record.status, record.first_token_at, _json(record.error), lease.job_id, lease.attempt,
        record.text, record.finish_reason, _int_array(record.token_ids),
        _json(record.logprobs), _json(record.response), has_result,
        prompt_tokens, record.completion_tokens, min(record.cached_tokens, prompt_tokens), record.reasoning_tokens,
        has_usage))
    return row is not None and row[0] == 1


def record_jobs(sessions: sessionmaker[Session], records: list[tuple[Lease, JobRecord]], *,
                db: HeldConnections | None = None) -> set[str]:
    """`record_job` for several jobs (distinct ids) in one statement, so one round trip and one
    transaction; the ids of those recorded (a job whose lease is lost is left out, as
    record_job's False)."""
    params: list[object] = []
    for lease, record in records:
        prompt_tokens = record.prompt_tokens or 0
        params += (lease.job_id, lease.attempt, record.status, record.first_token_at, _json(record.error),
                   record.text, record.finish_reason, _int_array(record.token_ids), _json(record.logprobs),
                   _json(record.response), record.finish_reason is not None, prompt_tokens,
                   record.completion_tokens, min(record.cached_tokens, prompt_tokens), record.reasoning_tokens,
                   record.prompt_tokens is not None)
    sql = _RECORD_MANY_SQL.format(values=",".join([_RECORD_MANY_ROW] * len(records)))
    run = db.execute_all if db is not None else partial(execute_all, engine_of(sessions))
    return {row[0] for row in run(sql, tuple(params))}


class GroupRecorder(GroupCommit[tuple[Lease, JobRecord], bool]):
    """`record_job` shared by the task threads, with group commit (rein.jobs.group_commit): jobs
    that end together (a batch's lines, which end in the same engine steps) are written by one
    `record_jobs` statement; each caller gets its own answer or error, as from `record_job`."""

    def __init__(self, sessions: sessionmaker[Session], max_group: int = 64,
                 on_batch_lines: Callable[[], None] | None = None) -> None:
        # The writers take turns: one held connection serves them all (no checkout, no pre-ping).
        db = HeldConnections(engine_of(sessions), shared=True)
        self._on_batch_lines = on_batch_lines

        def write_many(items: list[tuple[Lease, JobRecord]]) -> list[bool]:
            answers = _recorded(record_jobs(sessions, items, db=db), items)
            self._announce([lease for (lease, _), recorded in zip(items, answers, strict=True) if recorded])
            return answers

        def write_one(item: tuple[Lease, JobRecord]) -> bool:
            recorded = record_job(sessions, *item, db=db)
            self._announce([item[0]] if recorded else [])
            return recorded

        super().__init__(write_many=write_many, write_one=write_one, key=lambda item: item[0].job_id,
                         max_group=max_group, what="job records")

    def _announce(self, recorded: list[Lease]) -> None:
        # Once per written group with batch lines in it: the batch managers feed and finish
        # at once (rein.batches.wakeup).
        if self._on_batch_lines is not None and any(lease.batch_id is not None for lease in recorded):
            self._on_batch_lines()

    def record(self, lease: Lease, record: JobRecord) -> bool:
        """`record_job`, written with whatever else waits."""
        return self.call((lease, record))


def _recorded(recorded: set[str], items: list[tuple[Lease, JobRecord]]) -> list[bool]:
    return [lease.job_id in recorded for lease, _ in items]


def _int_array(values: list[int]) -> str:
    return "{" + ",".join(map(str, values)) + "}"


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


# The record: the job's status, its result and its usage in one statement (so one transaction
# and one round trip; rein.store.db.execute_one). The result and usage rows are written only
# when the UPDATE matched, i.e. while this attempt still holds the job, and each at most once.
_RECORD_SQL = """
WITH done AS (
    UPDATE jobs SET status = %s, finished_at = now(), first_token_at = %s, error = %s::jsonb,
                    lease_expires_at = NULL
     WHERE id = %s AND attempt = %s AND status = 'running'
    RETURNING id, tenant, key_id, model
), result_row AS (
    INSERT INTO results (job_id, text, finish_reason, token_ids, logprobs, response)
    SELECT id, %s, %s, %s::integer[], %s::jsonb, %s::jsonb FROM done WHERE %s
    ON CONFLICT (job_id) DO NOTHING
), usage_row AS (
    INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, cached_tokens,
                       reasoning_tokens)
    SELECT id, tenant, key_id, model, %s, %s, %s, %s FROM done WHERE %s
    ON CONFLICT (job_id) DO NOTHING
)
SELECT count(*) FROM done"""


# record_jobs: the same writes for several jobs, their values in one VALUES list.
_RECORD_MANY_ROW = ("(%s::text, %s::integer, %s::text, %s::timestamptz, %s::jsonb, %s::text, %s::text, "
                    "%s::integer[], %s::jsonb, %s::jsonb, %s::boolean, %s::integer, %s::integer, %s::integer, "
                    "%s::integer, %s::boolean)")
_RECORD_MANY_SQL = """
WITH input (id, attempt, status, first_token_at, error, text, finish_reason, token_ids, logprobs, response,
            has_result, prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens, has_usage) AS (VALUES {values}
), done AS (
    UPDATE jobs SET status = input.status, finished_at = now(), first_token_at = input.first_token_at,
                    error = input.error, lease_expires_at = NULL
      FROM input
     WHERE jobs.id = input.id AND jobs.attempt = input.attempt AND jobs.status = 'running'
    RETURNING jobs.id, jobs.tenant, jobs.key_id, jobs.model, input.text, input.finish_reason, input.token_ids,
              input.logprobs, input.response, input.has_result, input.prompt_tokens, input.completion_tokens,
              input.cached_tokens, input.reasoning_tokens, input.has_usage
), result_row AS (
    INSERT INTO results (job_id, text, finish_reason, token_ids, logprobs, response)
    SELECT id, text, finish_reason, token_ids, logprobs, response FROM done WHERE has_result
    ON CONFLICT (job_id) DO NOTHING
), usage_row AS (
    INSERT INTO usage (job_id, tenant, key_id, model, prompt_tokens, completion_tokens, cached_tokens,
                       reasoning_tokens)
    SELECT id, tenant, key_id, model, prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens
      FROM done WHERE has_usage
    ON CONFLICT (job_id) DO NOTHING
)
SELECT id FROM done"""




