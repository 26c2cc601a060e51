"""Image parts of chat messages (OpenAI's `{"type": "image_url", "image_url": {"url", "detail"}}`):
the one small parser `rein.LLM.chat` (and, later, `rein run-batch`) uses.

MINIMAL VERSION (h-vision): data URLs only (`data:image/png;base64,...`); the service's parser
(fetching http(s) URLs, limits, the job message) is h-images' and replaces this on merge.
Torch-free.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from rein.core.images import ImageError, ImageInput

IMAGE_PART_TYPES = ("image_url", "image")


def image_parts(messages: list[Any]) -> tuple[list[Any], list[ImageInput]]:
    """The messages with each image part written as `{"type": "image"}` (what chat templates
    render as the model's image placeholder) and the images, in order; ImageError (naming the
    part) for an image part that is not a data URL or does not decode."""
    images: list[ImageInput] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                where = f"messages[{i}].content[{j}]"
                spec = part.get("image_url")
                if isinstance(spec, str):
                    spec = {"url": spec}
                if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                    raise ImageError(f"{where}: an image part needs image_url.url", param=where)
                images.append(ImageInput.of(data_url_bytes(spec["url"], where), spec.get("detail")))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a base64 `data:` URL; ImageError for anything else."""
    if not url.startswith("data:"):
        raise ImageError(f"{where}: only data: URLs (data:image/png;base64,...) are taken here", param=where)
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ImageError(f"{where}: the data URL must be base64-encoded", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the data URL's base64 does not decode", param=where) from None
