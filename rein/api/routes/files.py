"""The OpenAI Files API: POST /v1/files (multipart), GET /v1/files, GET /v1/files/{id},
GET /v1/files/{id}/content, DELETE /v1/files/{id}. Needs the `batch` scope.

An upload is streamed: the multipart parser spools the file part to a temporary file (at
most 1 MiB of it in memory) and it is copied to the FileStore chunk by chunk, counting
bytes against REIN_MAX_FILE_BYTES; a request whose Content-Length already says it is too
large is refused before its body is read. Contents are streamed back the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile

from rein.api.checked_route import CheckedRoute
from rein.api.deps import SessionDep, SessionsDep, SettingsDep, require_scope
from rein.api.errors import APIError
from rein.api.schemas import ErrorResponse
from rein.batches.repository import file_public, get_file_for_tenant, list_for_tenant
from rein.batches.schemas import FileDeleted, FileList, FileObject
from rein.core.filestore import FileStore, FileTooLargeError
from rein.core.keys import KeyInfo
from rein.core.models import File, new_file_id
from rein.input_checks import text_problem

router = APIRouter(prefix="/v1/files", tags=["files"], route_class=CheckedRoute)

BatchKey = Annotated[KeyInfo, Depends(require_scope("batch"))]
CHUNK_BYTES = 1 << 20
# Room for the multipart framing and the purpose field around the file itself.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
UPLOAD_PURPOSES = ("batch",)

_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}}


def get_filestore(request: Request) -> FileStore:
    return request.app.state.filestore


FileStoreDep = Annotated[FileStore, Depends(get_filestore)]


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than this deployment's limit of {limit} bytes "
                         f"({limit / 2**20:.0f} MiB, REIN_MAX_FILE_BYTES). Split it into smaller files.",
                    param="file", code="file_too_large")


def _chunks(upload: UploadFile) -> Iterator[bytes]:
    while chunk := upload.file.read(CHUNK_BYTES):
        yield chunk


@router.post("", response_model=FileObject,
             responses={**_ERRORS, 400: {"model": ErrorResponse}, 413: {"model": ErrorResponse}},
             openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
                 "type": "object", "required": ["file", "purpose"],
                 "properties": {"file": {"type": "string", "format": "binary"},
                                "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}})
async def upload_file(request: Request, key: BatchKey, sessions: SessionsDep, settings: SettingsDep,
                      store: FileStoreDep) -> FileObject:
    """Upload a JSONL batch input file (multipart fields `file` and `purpose=batch`)."""
    limit = settings.max_file_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit + MULTIPART_OVERHEAD_BYTES:
        raise _too_large(limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(400, "Upload the file as multipart/form-data with the fields `file` and `purpose`.",
                       param="file", code="invalid_value")
    async with request.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if not isinstance(purpose, str) or purpose not in UPLOAD_PURPOSES:
            raise APIError(400, f"purpose must be one of {', '.join(UPLOAD_PURPOSES)}, got {purpose!r}: "
                                "rein stores files for the Batch API", param="purpose", code="invalid_value")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "'file' is a required multipart field holding the file's contents",
                           param="file", code="invalid_value")
        filename = upload.filename or "upload.jsonl"
        problem = text_problem(filename)
        if problem is not None:
            raise APIError(400, f"the file name {problem}", param="file", code="invalid_value")
        file_id = new_file_id()
        try:
            size = await run_in_threadpool(store.save, file_id, _chunks(upload), limit)
        except FileTooLargeError:
            raise _too_large(limit) from None
        row = File(id=file_id, tenant=key.tenant, key_id=key.key_id, purpose=purpose, bytes=size,
                   filename=filename[:255])

    def insert() -> File:
        with sessions.begin() as session:
            session.add(row)
        return row

    try:
        return file_public(await run_in_threadpool(insert))
    except BaseException:
        store.delete(file_id)
        raise


@router.get("", response_model=FileList, responses=_ERRORS)
def list_files(session: SessionDep, key: BatchKey,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
               after: Annotated[str | None, Query(description="A file id: list the files older than it.")] = None,
               purpose: Annotated[str | None, Query(description="Only files of this purpose.")] = None,
               ) -> FileList:
    """The caller's files, newest first."""
    filters = [File.purpose == purpose] if purpose else []
    files, has_more = list_for_tenant(session, File, key.tenant, limit, after, *filters)
    return FileList(data=[file_public(f) for f in files], first_id=files[0].id if files else None,
                    last_id=files[-1].id if files else None, has_more=has_more)


@router.get("/{file_id}", response_model=FileObject, responses=_ERRORS)
def get_file(file_id: str, session: SessionDep, key: BatchKey) -> FileObject:
    return file_public(get_file_for_tenant(session, key.tenant, file_id))


@router.get("/{file_id}/content", responses={**_ERRORS, 200: {"content": {"application/jsonl": {}}}})
def get_file_content(file_id: str, session: SessionDep, key: BatchKey, store: FileStoreDep
                     ) -> StreamingResponse:
    """The file's bytes, streamed."""
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

    return StreamingResponse(stream(), media_type="application/jsonl")


@router.delete("/{file_id}", response_model=FileDeleted, responses=_ERRORS)
def delete_file(file_id: str, session: SessionDep, key: BatchKey, store: FileStoreDep) -> FileDeleted:
    """Delete the file (a batch already running from it keeps its requests)."""
    file = get_file_for_tenant(session, key.tenant, file_id)
    session.delete(file)
    session.commit()
    store.delete(file_id)
    return FileDeleted(id=file_id, deleted=True)
