"""A request's images as bytes, and where a job's images are kept until a worker runs it.

`ImageSources.resolve` turns the references a request names (rein.openai.images.ImageRef) into
`ImageInput`s: a data URL decoded (its size checked before the base64 is decoded), a file id
read from the Files API's store (the caller's own file, uploaded with purpose "vision"; another
tenant's file is "not found", as a missing one), an http(s) URL fetched under the SSRF rules of
rein.jobs.image_fetch, where the operator allows it. Each error is a 400 naming the image part
and the limit.

Storage: a job's images are stored once in the file store (REIN_FILES_URL, which every API
replica and worker reaches), content-addressed as `image-<sha256>` (`store_images`; writing an
image that is already there is skipped, and writing it twice leaves the same bytes). The job's
params and its queue message hold only `[{"sha256", "detail"}]` (`image_refs_of`), so a message
the reaper rebuilds from the job row names the same images, and Redis and Postgres never hold
image bytes. The worker reads them back with `load_images`. Each use is recorded in the
`stored_images` table, and the retention sweep (rein.jobs.retention) deletes an image unused for
REIN_IMAGE_RETENTION_SECONDS that no queued or running job names: an image is needed only until
its jobs have run.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable
from typing import Any

from PIL import Image as PILImage
from sqlalchemy import func, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from rein.core.image_limits import parse_fetch_policy, parse_mm_limits
from rein.core.images import ImageError, ImageInput, image_sha256, open_image
from rein.core.settings import Settings
from rein.jobs.errors import APIError
from rein.jobs.image_fetch import fetch_image
from rein.openai.errors import RequestError
from rein.openai.images import INVALID_IMAGE, ImageRef, check_image_count, decode_data_url
from rein.store.filestore import FileStore
from rein.store.tables import File, StoredImage

# The Files API purpose of an uploaded image (OpenAI's).
VISION_PURPOSE = "vision"
IMAGE_FILE_PREFIX = "image-"


def image_file_id(sha256: str) -> str:
    """The file store id an image is kept under (content-addressed)."""
    return IMAGE_FILE_PREFIX + sha256


def image_refs_of(images: Iterable[ImageInput]) -> list[dict[str, str]]:
    """What a job's params and message hold of its images: [{"sha256", "detail"}] in prompt order."""
    return [{"sha256": image.sha256, "detail": image.detail} for image in images]


class ImageSources:
    """Resolves image references for requests: the settings' limits and fetch policy, the file
    store, and (for file ids) the database, where the Files API's rows are."""

    def __init__(self, settings: Settings, store: FileStore | None = None,
                 sessions: sessionmaker[Session] | None = None) -> None:
        self.settings = settings
        self.store = store
        self.sessions = sessions
        self.policy = parse_fetch_policy(settings.image_fetch)

    def resolve(self, refs: list[ImageRef], tenant: str) -> list[ImageInput]:
        """Each reference's image (its bytes and sha256; not yet opened). RequestError (400)
        naming the image part, or APIError 404 for a file id the tenant has no file under."""
        images = []
        for ref in refs:
            try:
                data = self._bytes(ref, tenant)
            except ImageError as exc:
                raise image_request_error(exc, ref.param) from None
            images.append(ImageInput.of(data, ref.detail))
        return images

    def for_request(self, tenant: str) -> RequestImages:
        """The loader `rein.jobs.prepare.prepare` takes for one tenant's request."""
        return RequestImages(self, tenant)

    def _bytes(self, ref: ImageRef, tenant: str) -> bytes:
        limit = self.settings.max_image_bytes
        if ref.kind == "data":
            return decode_data_url(ref.value, limit)
        if ref.kind == "file":
            return self._file(ref, tenant, limit)
        settings = self.settings
        return fetch_image(ref.value, self.policy, max_bytes=limit, timeout=settings.image_fetch_timeout_seconds,
                           max_redirects=settings.image_fetch_max_redirects,
                           allow_private=settings.image_fetch_allow_private)

    def _file(self, ref: ImageRef, tenant: str, limit: int) -> bytes:
        if self.sessions is None or self.store is None:
            raise ImageError("file ids are not taken here: send the image as a data URL")
        with self.sessions() as session:
            row = session.scalars(select(File).where(
                File.id == ref.value, File.tenant == tenant,
                or_(File.expires_at.is_(None), File.expires_at > func.now()))).one_or_none()
        if row is None:   # another tenant's file reads as a missing one
            raise APIError(404, f"No file found with id '{ref.value}'.", param=f"{ref.param}.file_id",
                           code="file_not_found")
        if row.purpose != VISION_PURPOSE:
            raise ImageError(f"file {ref.value} was uploaded with purpose {row.purpose!r}; an image is uploaded "
                             f"with purpose {VISION_PURPOSE!r}")
        if row.bytes > limit:
            raise ImageError(f"file {ref.value} is {row.bytes:,} bytes; the limit is {limit:,} bytes "
                             "(REIN_MAX_IMAGE_BYTES)")
        try:
            with self.store.open(ref.value) as source:
                return source.read(limit + 1)
        except FileNotFoundError:
            raise APIError(404, f"The contents of file '{ref.value}' are missing from storage.",
                           param=f"{ref.param}.file_id", code="file_not_found") from None


# Images decoded at once in one process, each up to REIN_MAX_IMAGE_PIXELS x 3 bytes (RGB): bounds
# what checking requests' images can take of an API process's memory, whatever their number.
_DECODING = threading.BoundedSemaphore(2)


class RequestImages:
    """One tenant's request images: counted against REIN_LIMIT_MM_PER_PROMPT, resolved to bytes,
    and opened (rein.core.images.open_image: format, pixel cap before decoding, corrupt), each
    error a 400 naming the image part."""

    def __init__(self, sources: ImageSources, tenant: str) -> None:
        self.sources = sources
        self.tenant = tenant

    def load(self, refs: list[ImageRef]) -> tuple[list[ImageInput], list[Any]]:
        """(the images, a PIL image of each for the processor), in the order of `refs`.

        Each image is decoded once in full here (rein.core.images.open_image: a corrupt or
        truncated file is refused now, not in the worker), one at a time in the process
        (`_DECODING`), and its pixels dropped at once: the PIL image handed on is opened lazily,
        its size read from the header (all a processor needs to count an image's tokens; one
        that reads the pixels decodes them then). So a request of 8 images of 64 MP holds one
        decoded image at a time, not 1.5 GB."""
        settings = self.sources.settings
        check_image_count(refs, parse_mm_limits(settings.limit_mm_per_prompt))
        images = self.sources.resolve(refs, self.tenant)
        lazy = []
        for ref, image in zip(refs, images, strict=True):
            try:
                with _DECODING:
                    open_image(image.data, max_pixels=settings.max_image_pixels, max_bytes=settings.max_image_bytes,
                               param=ref.param).close()
            except ImageError as exc:
                raise image_request_error(exc, ref.param) from None
            lazy.append(PILImage.open(io.BytesIO(image.data)))
        return images, lazy


def image_request_error(error: ImageError, param: str) -> RequestError:
    """An ImageError as the 400 a request gets: the image part named first."""
    return RequestError(f"{param}: {error.message}", param, INVALID_IMAGE)


def store_images(store: FileStore, images: Iterable[ImageInput], sessions: sessionmaker[Session] | None = None
                 ) -> None:
    """Keep each image in the file store under its sha256 (skipped when already there), and
    record its use (`stored_images.last_used_at`, what the retention sweep goes by; `sessions`
    None: not recorded, for tests and tools without the database). The row first: a sweep
    deleting the image holds its row until the bytes are gone, so the size check below then
    finds them missing and writes them again."""
    images = list({image.sha256: image for image in images}.values())
    if sessions is not None and images:
        with sessions.begin() as session:
            session.execute(pg_insert(StoredImage).values(
                [{"sha256": image.sha256, "bytes": len(image.data)} for image in images])
                .on_conflict_do_update(index_elements=[StoredImage.sha256], set_={"last_used_at": func.now()}))
    for image in images:
        file_id = image_file_id(image.sha256)
        try:
            if store.size(file_id) == len(image.data):
                continue
        except FileNotFoundError:
            pass
        store.save(file_id, [image.data])


def load_images(store: FileStore, refs: list[dict[str, Any]]) -> list[ImageInput]:
    """A job's images read back from the file store (FileNotFoundError when one is gone; ValueError
    when its bytes no longer match their sha256)."""
    images = []
    for ref in refs:
        with store.open(image_file_id(ref["sha256"])) as source:
            data = source.read()
        if image_sha256(data) != ref["sha256"]:
            raise ValueError(f"the stored image {ref['sha256']} does not match its sha256")
        images.append(ImageInput(data, ref["sha256"], ref.get("detail") or "auto"))
    return images
