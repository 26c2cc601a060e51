"""Where file bytes live: a directory (a volume in compose) behind a small `FileStore` interface.

Files (uploaded batch inputs, generated batch outputs and error files) are stored one per
id under `settings.files_url` (or `files_dir`); their metadata (tenant, name, purpose, size) is a row in the
`files` table, and tenant checks happen there, never here. A directory was chosen over
Postgres large objects because outputs are written and read as streams of lines, a volume
is easy to back up or move to network storage, and Postgres stays small. Object storage
(`REIN_FILES_URL=s3://bucket/prefix`, rein.store.s3) provides the same methods, for API
replicas on several hosts; `filestore_for` picks one from the settings.

Writes are atomic: bytes go to a temporary file in the same directory, renamed into place
when complete, so a reader never sees half a file and a crash leaves no partial one under
its id (a rewrite of the same id, as the batch manager does after a restart, replaces it).
A file that arrives in pieces from an async caller (an upload read off the socket) is
written through `create`: a `NewFile` it appends to, then commits or discards.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rein.core.settings import Settings

_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class FileTooLargeError(ValueError):
    """More bytes came than the limit allows; nothing was stored."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the file is larger than the limit of {limit} bytes")
        self.limit = limit


class NewFile(Protocol):
    """A file being written: invisible under its id until `commit`; `discard` drops it."""

    size: int
    """Bytes written so far."""

    def write(self, data: bytes) -> None:
        """Append data."""

    def commit(self) -> int:
        """Store the bytes under the file's id (replacing any); the byte count."""

    def discard(self) -> None:
        """Drop what was written (nothing once committed; safe to call twice)."""


class FileStore(Protocol):
    def create(self, file_id: str) -> NewFile:
        """A new, empty file for file_id, stored when committed."""

    def save(self, file_id: str, chunks: Iterable[bytes], max_bytes: int | None = None) -> int:
        """Store the chunks under file_id; the byte count (FileTooLargeError past max_bytes)."""

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[str]]:
        """A text file to write file_id into; stored when the block ends without error."""

    def open(self, file_id: str) -> IO[bytes]:
        """The stored bytes (FileNotFoundError when missing)."""

    def size(self, file_id: str) -> int:
        """The stored byte count."""

    def delete(self, file_id: str) -> None:
        """Remove file_id's bytes (no error when already gone)."""


def filestore_for(settings: Settings) -> FileStore:
    """The store REIN_FILES_URL names (a path, or s3://bucket/prefix), else REIN_FILES_DIR."""
    url = settings.files_url or settings.files_dir
    if url.startswith("s3://"):
        from rein.store.s3 import S3FileStore  # boto3 only where object storage is used

        return S3FileStore(url)
    if "://" in url:
        raise ValueError(f"REIN_FILES_URL={url}: want a directory path or s3://bucket/prefix")
    return LocalFileStore(url)


def save_chunks(new: NewFile, chunks: Iterable[bytes], max_bytes: int | None = None) -> int:
    """Write `chunks` into `new` and commit it (its size); past `max_bytes`, FileTooLargeError
    and nothing stored: every store's `save`."""
    try:
        for chunk in chunks:
            if max_bytes is not None and new.size + len(chunk) > max_bytes:
                raise FileTooLargeError(max_bytes)
            new.write(chunk)
        return new.commit()
    finally:
        new.discard()


class LocalFileStore:
    """A FileStore on a local directory, created at the first write (so an API that never
    stores a file starts even where the default directory cannot be created)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _temporary(self, prefix: str) -> tuple[int, str]:
        self.root.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(dir=self.root, prefix=prefix)

    def path(self, file_id: str) -> Path:
        if not _SAFE_ID.fullmatch(file_id):    # ids are ours, but never let one name a path
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def create(self, file_id: str) -> NewFile:
        target = self.path(file_id)
        fd, tmp = self._temporary(".upload-")
        return _LocalNewFile(os.fdopen(fd, "wb"), Path(tmp), target)

    def save(self, file_id: str, chunks: Iterable[bytes], max_bytes: int | None = None) -> int:
        return save_chunks(self.create(file_id), chunks, max_bytes)

    @contextmanager
    def writer(self, file_id: str) -> Iterator[IO[str]]:
        target = self.path(file_id)
        fd, tmp = self._temporary(".write-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                yield out
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def open(self, file_id: str) -> IO[bytes]:
        return open(self.path(file_id), "rb")  # noqa: SIM115 (the caller closes it)

    def size(self, file_id: str) -> int:
        return self.path(file_id).stat().st_size

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)


class _LocalNewFile:
    """A temporary file beside its target, renamed onto it by `commit`."""

    def __init__(self, out: IO[bytes], tmp: Path, target: Path) -> None:
        self._out, self._tmp, self._target = out, tmp, target
        self._finished = False
        self.size = 0

    def write(self, data: bytes) -> None:
        self._out.write(data)
        self.size += len(data)

    def commit(self) -> int:
        self._out.close()
        os.replace(self._tmp, self._target)
        self._finished = True
        return self.size

    def discard(self) -> None:
        if self._finished:
            return
        self._finished = True
        self._out.close()
        self._tmp.unlink(missing_ok=True)
