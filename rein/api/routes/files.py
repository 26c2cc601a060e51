"""The OpenAI Files API: POST /v1/files (multipart), GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}. Needs the `batch` scope.

An upload is read as it arrives (rein.api.multipart_upload): its file part goes straight to
the FileStore, counted byte by byte, and reading stops with a 413 the moment it passes the
room this upload has: REIN_MAX_FILE_BYTES, or less when the tenant's storage quota
(REIN_MAX_TENANT_FILE_BYTES) has less left. A request whose Content-Length already says it
is too large is refused before its body is read; one without (chunked) is cut off at the
limit, so no more than the limit (plus the multipart overhead) is ever read or stored.
Nothing is stored under the file's id unless the upload is accepted. Contents are streamed
back chunk by chunk.

The quota counts everything the tenant stores (rein.jobs.retention.stored_bytes): its uploads,
the output and error files its batches generated and its stored job results. A batch writes
its results whatever the quota (they count toward the next upload); what is past its
retention or its `expires_at` is deleted (rein.jobs.retention, rein.batches.expiry).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy import Integer, cast, func, select
from sqlalchemy.orm import Session, sessionmaker

from rein.api.checked_route import CheckedRoute
from rein.api.deps import SessionDep, SessionsDep, SettingsDep, require_scope
from rein.api.multipart_upload import receive_upload
from rein.api.schemas import ErrorResponse
from rein.batches.expiry import (
    MAX_EXPIRY_SECONDS,
    MIN_EXPIRY_SECONDS,
    default_expiry_seconds,
    expires_after_from_form,
    expires_at_after,
)
from rein.batches.repository import (
    file_not_expired,
    file_public,
    get_file_for_tenant,
    list_for_tenant,
)
from rein.batches.schemas import FileDeleted, FileList, FileObject
from rein.core.input_checks import text_problem
from rein.jobs.errors import APIError
from rein.jobs.retention import StoredBytes, stored_bytes
from rein.store.filestore import FileStore, FileTooLargeError
from rein.store.keys import KeyInfo
from rein.store.tables import File, new_file_id

router = APIRouter(prefix="/v1/files", tags=["files"], route_class=CheckedRoute)

BatchKey = Annotated[KeyInfo, Depends(require_scope("batch"))]
CHUNK_BYTES = 1 << 20
# Room for the multipart framing and the purpose field around the file itself.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
# batch: a batch input file; vision: an image a request names by its file_id (rein.jobs.image_sources).
UPLOAD_PURPOSES = ("batch", "vision")
# Namespace of the per-tenant advisory lock an upload's row is inserted under ("file"),
# beside the batch manager's ("batc").
QUOTA_LOCK_NAMESPACE = 0x66696C65

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


def get_filestore(request: Request) -> FileStore:
    return request.app.state.filestore


FileStoreDep = Annotated[FileStore, Depends(get_filestore)]


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than this deployment's limit of {limit} bytes "
                         f"({limit / 2**20:.0f} MiB, REIN_MAX_FILE_BYTES). Split it into smaller files.",
                    param="file", code="file_too_large")


def over_quota(used: StoredBytes, quota: int, size: int | None = None, this: str | None = None,
               param: str = "file") -> APIError:
    """413 `storage_quota_exceeded`, saying what the tenant stores (for an upload, or `this`)."""
    this = this or ("This upload" if size is None else f"This file of {size} bytes")
    return APIError(413, f"{this} would take your storage past its quota of {quota} bytes ({quota / 2**30:.1f} "
                         f"GiB, REIN_MAX_TENANT_FILE_BYTES): {used.total} bytes are stored ({used.uploads} in "
                         f"uploaded files, {used.outputs} in batch output and error files, {used.results} in "
                         f"job results), so at most {max(quota - used.total, 0)} more bytes fit. Delete files "
                         "you no longer need with DELETE /v1/files/{file_id} (GET /v1/files lists them, output "
                         "files included); results expire after this deployment's retention "
                         "(REIN_RESULT_RETENTION_DAYS) and files at their expires_at.",
                    param=param, code="storage_quota_exceeded")


def _used_bytes(sessions: sessionmaker[Session], tenant: str) -> StoredBytes:
    with sessions() as session:
        return stored_bytes(session, tenant)


def _insert_within_quota(sessions: sessionmaker[Session], row: File, quota: int) -> File:
    """Insert the file's row unless it takes the tenant past its quota (APIError 413).

    The upload was already limited to the room left when it began, but a tenant's uploads
    running at the same time each had that room; they meet here, one at a time under the
    tenant's advisory lock, and the one that no longer fits is refused. So the stored rows
    never exceed the quota, while the disk may briefly hold the bytes of concurrent uploads
    beyond it (each at most REIN_MAX_FILE_BYTES) until their refusal removes them.
    """
    with sessions.begin() as session:
        session.execute(select(func.pg_advisory_xact_lock(cast(QUOTA_LOCK_NAMESPACE, Integer),
                                                          func.hashtext(row.tenant))))
        used = stored_bytes(session, row.tenant)
        if used.total + row.bytes > quota:
            raise over_quota(used, quota, row.bytes)
        session.add(row)
        session.flush()
        session.refresh(row)        # expires_at, computed by Postgres from the row's created_at
    return row


@router.post("", response_model=FileObject,
             responses={**_ERRORS, 400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}},
             openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                 "type": "object", "required": ["file", "purpose"],
                 "properties": {"file": {"type": "string", "format": "binary"},
                                "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)},
                                "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                                "expires_after[seconds]": {"type": "integer", "minimum": MIN_EXPIRY_SECONDS,
                                                           "maximum": MAX_EXPIRY_SECONDS}}}}}}})
async def upload_file(request: Request, key: BatchKey, sessions: SessionsDep, settings: SettingsDep,
                      store: FileStoreDep) -> FileObject:
    """Upload a JSONL batch input file (multipart fields `file` and `purpose=batch`), or an image
    (`purpose=vision`) that chat and Responses requests name by its id; optionally
    `expires_after[anchor]=created_at` and `expires_after[seconds]`, else it expires after
    REIN_BATCH_FILE_EXPIRY_SECONDS)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "Upload the file as multipart/form-data with the fields `file` and `purpose`.",
                       param="file", code="invalid_value")
    max_file, quota = settings.max_file_bytes, settings.max_tenant_file_bytes
    used = await run_in_threadpool(_used_bytes, sessions, key.tenant)
    if used.total >= quota:
        raise over_quota(used, quota)
    # This upload's room: the file limit, or what is left of the quota when that is less.
    limit = min(max_file, quota - used.total)
    refusal = _too_large(max_file) if limit == max_file else over_quota(used, quota)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD_BYTES:
        raise refusal
    file_id = new_file_id()
    try:
        upload = await receive_upload(request, store, file_id, file_field="file", max_bytes=limit,
                                      overhead_bytes=MULTIPART_OVERHEAD_BYTES, max_fields=8)
    except FileTooLargeError:
        raise refusal from None
    committed = False
    try:
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}: "
                                "rein stores batch input files and images", param="purpose", code="invalid_value")
        if upload.file is None:
            raise APIError(400, "'file' is a required multipart field holding the file's contents",
                           param="file", code="invalid_value")
        expiry = expires_after_from_form(upload.fields)
        if expiry is None:
            expiry = default_expiry_seconds(settings)
        filename = upload.filename or ("image" if purpose == "vision" else "upload.jsonl")
        problem = text_problem(filename)
        if problem is not None:
            raise APIError(400, f"the file name {problem}", param="file", code="invalid_value")
        await run_in_threadpool(upload.file.commit)
        committed = True
        row = File(id=file_id, tenant=key.tenant, key_id=key.key_id, purpose=purpose, bytes=upload.size,
                   filename=filename[:255], expires_at=expires_at_after(expiry))
        return file_public(await run_in_threadpool(_insert_within_quota, sessions, row, quota))
    except BaseException:
        if upload.file is not None:
            upload.file.discard()
        if committed:
            store.delete(file_id)
        raise


@router.get("", response_model=FileList, responses=_ERRORS)
def list_files(session: SessionDep, key: BatchKey,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               after: Annotated[str | None, Query(description="A file id: list the files after it in `order`.")]
               = None,
               purpose: Annotated[str | None, Query(description="Only files of this purpose.")] = None,
               order: Annotated[Literal["asc", "desc"], Query(description="By creation time: desc (newest "
                                                                          "first, the default) or asc.")] = "desc",
               ) -> FileList:
    """The caller's files, newest first unless `order=asc` (OpenAI's defaults: 10,000 a page, desc)."""
    filters = [file_not_expired(), *([File.purpose == purpose] if purpose else [])]
    files, has_more = list_for_tenant(session, File, key.tenant, limit, after, *filters, order=order)
    return FileList(data=[file_public(f) for f in files], first_id=files[0].id if files else None,
                    last_id=files[-1].id if files else None, has_more=has_more)


@router.get("/{file_id}", response_model=FileObject, responses=_ERRORS)
def get_file(file_id: str, session: SessionDep, key: BatchKey) -> FileObject:
    return file_public(get_file_for_tenant(session, key.tenant, file_id))


@router.get("/{file_id}/content", responses={**_ERRORS, 200: {"content": {"application/jsonl": {}}}})
def get_file_content(file_id: str, request: Request, sessions: SessionsDep, key: BatchKey, store: FileStoreDep
                     ) -> StreamingResponse:
    """The file's bytes, streamed. The file row is read in a session closed before the first byte
    goes out: a slow reader holds no database connection."""
    with sessions() as session:
        get_file_for_tenant(session, key.tenant, file_id)
    try:
        source = store.open(file_id)
    except FileNotFoundError:
        raise APIError(404, f"The contents of file '{file_id}' are missing from storage.",
                       code="not_found") from None

    def stream() -> Iterator[bytes]:
        with source:
            while chunk := source.read(CHUNK_BYTES):
                yield chunk

    return download_response(request, key, stream(), on_refused=source.close)


# How long a client is told to wait when its key holds all its download slots.
DOWNLOAD_RETRY_AFTER = 5


def download_response(request: Request, key: KeyInfo, chunks: Iterator[bytes],
                      on_refused: Callable[[], object] | None = None) -> StreamingResponse:
    """A JSONL download holding one of the key's download slots until it ends (or 429
    `too_many_downloads` with Retry-After when the key holds REIN_MAX_DOWNLOADS_PER_KEY)."""
    slots = request.app.state.download_slots
    if not slots.acquire(key.key_id):
        if on_refused is not None:
            on_refused()
        raise APIError(429, f"This key already has {slots.per_key} downloads in progress on this server, its "
                            f"limit (REIN_MAX_DOWNLOADS_PER_KEY). Wait for one to finish, or retry after "
                            f"{DOWNLOAD_RETRY_AFTER} s.", type="requests", code="too_many_downloads",
                       headers={"Retry-After": str(DOWNLOAD_RETRY_AFTER)})

    def held() -> Iterator[bytes]:
        try:
            yield from chunks
        finally:
            slots.release(key.key_id)

    return StreamingResponse(held(), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted, responses=_ERRORS)
def delete_file(file_id: str, session: SessionDep, key: BatchKey, store: FileStoreDep) -> FileDeleted:
    """Delete the file (a batch already running from it keeps its requests)."""
    file = get_file_for_tenant(session, key.tenant, file_id)
    session.delete(file)
    session.commit()
    store.delete(file_id)
    return FileDeleted(id=file_id, deleted=True)
