"""A batch's output and error lines, in OpenAI's batch output format, and its result files.

Output line (a request that succeeded):
    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code": 200,
     "request_id": <job id>, "body": <exactly the synchronous endpoint's body>}, "error": null}
Error line, a request that failed: `response` carries the status code and the error body;
a request that never finished because the batch was cancelled or expired (or the request
itself was cancelled through the jobs API):
    {"id": ..., "custom_id": ..., "response": null,
     "error": {"code": "batch_cancelled" | "batch_expired" | "request_cancelled", "message": ...}}

Lines come in input-file order. The same generator serves the partial views while a batch
runs (GET /v1/batches/{id}/output and /errors) and writes the files when it ends, so the
two never differ; line ids are derived from job ids, so they are stable too. The files get
ids derived from the batch id: writing them again after a crash replaces, never duplicates.
They expire as the batch's `output_expires_after` (or the default when it was created) says,
counted from when they are written (rein.batches.expiry).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from rein.batches.expiry import expires_at_after
from rein.jobs.results import response_body
from rein.store.filestore import FileStore
from rein.store.tables import Batch, File, Job, Result, Usage

Kind = Literal["output", "errors"]
FETCH_ROWS = 500
_FILE_IDS = uuid.UUID("6b1f0f5e-2c55-4a57-9d55-7265696e6261")


def line_id(job_id: str) -> str:
    return "batch_req_" + job_id.removeprefix("job_")


def result_file_id(batch_id: str, kind: Kind) -> str:
    return f"file-{uuid.uuid5(_FILE_IDS, f'{batch_id}:{kind}').hex}"


def _dump(line: dict[str, Any]) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")) + "\n"


def _status_code(error: dict[str, Any]) -> int:
    return 400 if error.get("type") == "invalid_request_error" else 500


def batch_lines(session: Session, batch: Batch, kind: Kind) -> Iterator[str]:
    """The batch's output or error lines so far, in input order (JSONL text, one per line)."""
    for _, line in numbered_lines(session, batch, kind):
        yield line


def numbered_lines(session: Session, batch: Batch, kind: Kind, after: int = 0,
                   limit: int | None = None) -> Iterator[tuple[int, str]]:
    """(input line number, JSONL text) of the batch's output or error lines past line `after`,
    in input order, at most `limit` of them (a page: see batch_line_pages)."""
    if kind == "output":
        query = (select(Job, Result, Usage.cached_tokens, Usage.reasoning_tokens).join(Result, Result.job_id == Job.id)
                 .outerjoin(Usage, Usage.job_id == Job.id)
                 .where(Job.batch_id == batch.id, Job.status == "succeeded", Job.batch_line > after)
                 .order_by(Job.batch_line).limit(limit).execution_options(yield_per=FETCH_ROWS))
        for job, result, cached_tokens, reasoning_tokens in session.execute(query):
            yield job.batch_line, _dump({"id": line_id(job.id), "custom_id": job.custom_id,
                                         "response": {"status_code": 200, "request_id": job.id,
                                                      "body": response_body(job, result, cached_tokens or 0,
                                                                            reasoning_tokens)},
                                         "error": None})
        return
    if batch.expired_at is not None:
        dropped, reason = "batch_expired", "the batch's completion window closed before this request finished"
    elif batch.cancelling_at is not None:
        dropped, reason = "batch_cancelled", "the batch was cancelled before this request finished"
    else:
        dropped, reason = "request_cancelled", "the request was cancelled (POST /v1/jobs/{id}/cancel)"
    rows = session.execute(
        select(Job.id, Job.custom_id, Job.status, Job.error, Job.batch_line)
        .where(Job.batch_id == batch.id, Job.status.in_(("failed", "cancelled")), Job.batch_line > after)
        .order_by(Job.batch_line).limit(limit).execution_options(yield_per=FETCH_ROWS))
    for job_id, custom_id, status, error, number in rows:
        if status == "failed":
            error = {"message": "the request failed", "type": "server_error", "code": None} | (error or {})
            line = {"id": line_id(job_id), "custom_id": custom_id,
                    "response": {"status_code": _status_code(error), "request_id": job_id,
                                 "body": {"error": {**error, "param": error.get("param")}}},
                    "error": None}
        else:
            line = {"id": line_id(job_id), "custom_id": custom_id, "response": None,
                    "error": {"code": dropped, "message": reason}}
        yield number, _dump(line)


def batch_line_pages(sessions: sessionmaker[Session], load_batch: Callable[[Session], Batch], kind: Kind,
                     page_rows: int | None = None) -> Iterator[str]:
    """The same lines as batch_lines, read a page at a time, each page in a short session of its
    own: a client that reads slowly holds no database connection between pages (a download
    can take minutes; forty slow readers once emptied a process's pool)."""
    page_rows = page_rows or FETCH_ROWS
    after = 0
    while True:
        with sessions() as session:
            page = list(numbered_lines(session, load_batch(session), kind, after, page_rows))
        for _, line in page:
            yield line
        if len(page) < page_rows:
            return
        after = page[-1][0]


def write_result_files(session: Session, store: FileStore, batch: Batch) -> tuple[str | None, str | None]:
    """Write the output and error files (each only when it has lines); (output id, error id)."""
    ids: list[str | None] = []
    for kind, suffix in (("output", "output"), ("errors", "error")):
        file_id = result_file_id(batch.id, kind)
        count = 0
        with store.writer(file_id) as out:
            for text in batch_lines(session, batch, kind):
                out.write(text)
                count += 1
        if count == 0:
            store.delete(file_id)
            ids.append(None)
            continue
        size = store.size(file_id)
        # A rewrite (after a restart) keeps the first write's created_at and expires_at.
        session.execute(insert(File).values(
            id=file_id, tenant=batch.tenant, key_id=batch.key_id, filename=f"{batch.id}_{suffix}.jsonl",
            purpose="batch_output", bytes=size, expires_at=expires_at_after(batch.output_expires_after_seconds),
        ).on_conflict_do_update(index_elements=[File.id], set_={"bytes": size}))
        ids.append(file_id)
    return ids[0], ids[1]
