"""Images in requests: what one is as it travels (`ImageInput`), and the one place an image's
bytes are opened and checked (`open_image`).

Every path that takes an image (the API's intake, a batch line, `rein run-batch`, `rein.LLM`,
the worker before its engine runs the image processor) opens it here, so each refuses the same
images with the same words: a format rein does not take, a file that does not decode, and a
decompression bomb, refused by its declared size before its pixels are decoded. Pillow reads the
header (`Image.open` is lazy), so a 100,000 x 100,000 PNG of a few kilobytes is refused without
allocating its 40 GB. Torch-free: the API imports it.

An image is named by the SHA-256 of its bytes (`ImageInput.sha256`): the engine's encoder cache
and the prefix cache's keys use it, so the same image sent twice is the same image, and two
different images never share anything.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rein.core.input_checks import BadInput

if TYPE_CHECKING:
    from PIL.Image import Image

# The formats rein decodes (Pillow's names); what OpenAI's vision input takes, plus BMP and TIFF.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# OpenAI's "detail" values. "low" asks for the model's smallest resolution, "high" its largest;
# a model with one resolution ignores it.
DETAILS = ("auto", "low", "high")
# Pixels (width x height) an image may declare: 64 megapixels, beyond any model's input (Qwen2-VL
# caps at 12.8 MP) and far below what a bomb declares. REIN_MAX_IMAGE_PIXELS sets it.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
# Bytes of one image file: 20 MB, OpenAI's limit for an image in a request.
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024


class ImageError(BadInput):
    """An image rein cannot take: the message says what was wrong and the limit (a 400)."""


@dataclass(frozen=True)
class ImageInput:
    """One image of a request: its encoded file (`data`, PNG/JPEG/...), its SHA-256 (hex) and
    the `detail` asked for. Plain data, so it travels to an engine process as it is."""

    data: bytes
    sha256: str
    detail: str = "auto"

    @classmethod
    def of(cls, data: bytes, detail: str | None = None) -> ImageInput:
        detail = detail or "auto"
        if detail not in DETAILS:
            raise ImageError(f"detail must be one of {', '.join(DETAILS)}, got {detail!r}", param="detail")
        return cls(data, image_sha256(data), detail)


def image_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               max_bytes: int = DEFAULT_MAX_IMAGE_BYTES, param: str | None = None) -> Image:
    """The decoded RGB image of `data`; ImageError (naming `param`) when it is too large, not an
    image, in a format rein does not take, declares more than `max_pixels` pixels (checked
    before decoding them), or fails to decode."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise ImageError(f"the image is {len(data):,} bytes; the limit is {max_bytes:,} bytes: send a smaller "
                         f"or more compressed image", param=param)
    if not data:
        raise ImageError("the image is empty (0 bytes)", param=param)
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb guard warns (and errors at twice its limit); rein's cap is the rule.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"the data is not an image rein can read; send one of {', '.join(IMAGE_FORMATS)}",
                         param=param) from None
    except Image.DecompressionBombError as exc:   # Pillow's own guard, far above rein's cap
        raise ImageError(f"the image declares too many pixels ({exc}); the limit is {max_pixels:,} pixels "
                         f"(REIN_MAX_IMAGE_PIXELS): send a smaller image", param=param) from None
    except (OSError, ValueError) as exc:
        raise ImageError(f"the image cannot be read: {exc}", param=param) from None
    if image.format not in IMAGE_FORMATS:
        raise ImageError(f"images in {image.format} format are not taken; send one of {', '.join(IMAGE_FORMATS)}",
                         param=param)
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width}x{height} pixels: it has no pixels", param=param)
    if width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} ({width * height:,} pixels); the limit is "
                         f"{max_pixels:,} pixels (REIN_MAX_IMAGE_PIXELS): send a smaller image", param=param)
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image is corrupt or truncated: {exc}", param=param) from None
    return image if image.mode == "RGB" else image.convert("RGB")
