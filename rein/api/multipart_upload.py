"""Read a multipart/form-data upload as it arrives, its one file part straight into the FileStore.

Starlette's `request.form()` spools a file part whole to a temporary file before the route
sees it, so a body without Content-Length (chunked) could fill the disk before any size
check. Here python-multipart's streaming parser is fed the body chunk by chunk as the
server receives it: the file part's bytes are counted as they are parsed and written to a
`NewFile` of the store (through a buffer of at most `BUFFER_BYTES`, from the thread pool),
and reading stops with `FileTooLargeError` the moment they pass the limit; the rest of the
body is never read. Text fields and the multipart framing around the file are kept in
memory, bounded together by `overhead_bytes`. Nothing is stored under the file's id until
the caller commits; on any error the partial file is discarded.
"""

from __future__ import annotations

import codecs
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from python_multipart import MultipartParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from rein.jobs.errors import APIError
from rein.store.filestore import FileStore, FileTooLargeError, NewFile

BUFFER_BYTES = 1 << 20


@dataclass
class Upload:
    """What a multipart body held: its text fields (the first value of each), and the file
    part's name and bytes, written but not yet committed (both None when none came)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file: NewFile | None = None
    size: int = 0


def _bad(message: str, param: str | None = "file") -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


class _Parts:
    """python-multipart's callbacks: collects the fields, buffers and counts the file's bytes."""

    def __init__(self, charset: str, file_field: str, max_bytes: int, max_fields: int) -> None:
        self.charset, self.file_field, self.max_bytes, self.max_fields = charset, file_field, max_bytes, max_fields
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.file_bytes = 0
        self.pending = bytearray()     # parsed file bytes not yet written to the store
        self.ended = False
        self._field_count = 0
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._disposition = b""
        self._name = ""
        self._in_file = False
        self._value = bytearray()

    def decode(self, raw: bytes | bytearray) -> str:
        try:
            return raw.decode(self.charset)
        except UnicodeError:    # a decode error, or a codec that refuses to decode at all ("undefined")
            return raw.decode("latin-1")

    def on_part_begin(self) -> None:
        self._disposition, self._in_file, self._value = b"", False, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = bytes(self._header_value)
        self._header_name, self._header_value = bytearray(), bytearray()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        if b"name" not in options:
            raise _bad('Each multipart part needs a Content-Disposition header with a "name".', None)
        self._name = self.decode(options[b"name"])
        if b"filename" in options:
            if self._name != self.file_field or self.filename is not None:
                raise _bad(f"Send one file, in the multipart field '{self.file_field}'.")
            self.filename = self.decode(options[b"filename"])
            self._in_file = True
            return
        self._field_count += 1
        if self._field_count > self.max_fields:
            raise _bad(f"Too many multipart fields: at most {self.max_fields}.", None)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._in_file:
            self._value += data[start:end]     # bounded with the framing by the caller
            return
        self.file_bytes += end - start
        if self.file_bytes > self.max_bytes:
            raise FileTooLargeError(self.max_bytes)
        self.pending += data[start:end]

    def on_part_end(self) -> None:
        if not self._in_file:
            self.fields.setdefault(self._name, self.decode(self._value))

    def on_end(self) -> None:
        self.ended = True

    def take(self) -> bytes:
        data = bytes(self.pending)
        self.pending.clear()
        return data


def _charset(params: dict[bytes, bytes]) -> str:
    """The body's charset; latin-1 for one Python does not know. A codec that is not a text
    encoding (rot13, base64, zlib: bytes.decode raises LookupError for them) is a 400."""
    name = params.get(b"charset", b"utf-8").decode("latin-1")
    try:
        codec = codecs.lookup(name)
    except LookupError:
        return "latin-1"
    if not getattr(codec, "_is_text_encoding", True):
        raise _bad(f"The multipart/form-data charset {name[:40]!r} is not a text encoding: send the body "
                   f"as utf-8 (or leave the charset out).", None)
    return codec.name


async def receive_upload(request: Request, store: FileStore, file_id: str, *, file_field: str,
                         max_bytes: int, overhead_bytes: int, max_fields: int) -> Upload:
    """Read the request's multipart body, writing the part `file_field` to a new file of
    `store` for file_id (not committed: the caller commits or discards `Upload.file`).

    FileTooLargeError as soon as the file passes max_bytes; APIError (400) for a malformed
    body, 413 when the fields and framing around the file pass overhead_bytes.
    """
    _, params = parse_options_header(request.headers.get("content-type", ""))
    boundary = params.get(b"boundary")
    if not boundary:
        raise _bad("The multipart/form-data Content-Type has no boundary.")
    parts = _Parts(_charset(params), file_field, max_bytes, max_fields)
    new_file: NewFile | None = None
    received = 0

    async def flush() -> None:
        nonlocal new_file
        if new_file is None:
            new_file = await run_in_threadpool(store.create, file_id)
        if parts.pending:
            await run_in_threadpool(new_file.write, parts.take())

    try:
        try:
            parser = MultipartParser(boundary, {
                "on_part_begin": parts.on_part_begin, "on_part_data": parts.on_part_data,
                "on_part_end": parts.on_part_end, "on_header_field": parts.on_header_field,
                "on_header_value": parts.on_header_value, "on_header_end": parts.on_header_end,
                "on_headers_finished": parts.on_headers_finished, "on_end": parts.on_end})
            async with aclosing(request.stream()) as stream:
                async for chunk in stream:
                    received += len(chunk)
                    parser.write(chunk)
                    if received - parts.file_bytes > overhead_bytes:
                        raise APIError(413, f"The multipart fields and framing around the file exceed "
                                            f"{overhead_bytes} bytes; send only the fields `file` and `purpose`.",
                                       param=None, code="request_too_large")
                    if len(parts.pending) >= BUFFER_BYTES:
                        await flush()
        except FormParserError:
            raise _bad("The body is not valid multipart/form-data.") from None
        if not parts.ended:
            raise _bad("The multipart body ended before its closing boundary: was the upload cut off?")
        if parts.filename is not None:
            await flush()
        return Upload(parts.fields, parts.filename, new_file, parts.file_bytes)
    except BaseException:
        if new_file is not None:
            new_file.discard()     # here, not in a thread: it must run even when cancelled
        raise
