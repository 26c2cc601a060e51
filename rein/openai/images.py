"""Image parts of a request, parsed: where a chat or Responses body names an image, and what the
chat template sees in its place. Torch-free and I/O-free: the bytes are fetched elsewhere
(rein.jobs.image_sources), opened in rein.core.images.

Accepted shapes (each checked here, once, with a 400 naming the part):

* chat: `{"type": "image_url", "image_url": {"url": URL, "detail": "auto" | "low" | "high"}}`,
  and the shorthand `{"type": "image_url", "image_url": URL}` that vLLM takes;
* Responses (and chat too, as vLLM is lenient): `{"type": "input_image", "image_url": URL,
  "file_id": ID, "detail": ...}` with exactly one of image_url and file_id.

URL is a `data:image/...;base64,...` URL or an `http(s)://` URL (fetched only where the operator
allows it, REIN_IMAGE_FETCH); a file id names a file the caller uploaded (purpose "vision").

`template_content` is what the chat template gets for a message's parts: text parts as they
are, each image part as `{"type": "image"}` (transformers' multimodal chat format, which the
model's template turns into its image placeholder). `image_refs` lists the images in prompt
order, each with its JSON path (`messages[i].content[j]`) for the errors about it, and is where
the parts are checked; `PromptImages` carries a request's opened images and the model's
processor into rein.openai.prompts.chat_prompt, which expands them.

Also here, being pure parsing: `decode_data_url` (the size judged before decoding),
`image_parts` / `data_url_image` for the offline paths that take data URLs only (`rein.LLM`,
`rein run-batch`: one parser with the service's), and `without_image_data`, the body a job
keeps (its data URLs replaced by their hash: no image bytes in Postgres).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from rein.core.images import DEFAULT_MAX_IMAGE_BYTES, DETAILS, ImageError, ImageInput
from rein.core.input_checks import json_type
from rein.openai.errors import RequestError

IMAGE_PART_TYPES = ("image_url", "input_image")
TEXT_PART_TYPES = ("text", "input_text", "output_text")
# The error code of an image part rein cannot take (a malformed part, a bad image).
INVALID_IMAGE = "invalid_image"
IMAGES_NOT_SUPPORTED = "images_not_supported"
_DATA_URL = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)
# The longest http(s) URL taken (browsers' practical limit); a data URL is bounded by the body size.
MAX_URL_CHARS = 8192


@dataclass(frozen=True)
class ImageRef:
    """One image a request names: `kind` "data" (a data URL), "url" (http or https) or "file"
    (a file id, in `value`), the detail asked for, and where it is (`param`)."""

    kind: str
    value: str
    detail: str
    param: str


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def image_ref(part: dict[str, Any], where: str) -> ImageRef:
    """The image an `image_url` or `input_image` part names (RequestError 400 naming `where`)."""
    kind = part.get("type")
    detail: Any = None
    file_id: Any = None
    if kind == "image_url":
        value = part.get("image_url")
        if isinstance(value, dict):
            unknown = set(value) - {"url", "detail"}
            if unknown:
                raise RequestError(f"{where}.image_url holds unknown field(s) {', '.join(sorted(unknown))}: it "
                                   "takes url and detail", f"{where}.image_url")
            url, detail = value.get("url"), value.get("detail")
            url_param = f"{where}.image_url.url"
        elif isinstance(value, str):   # vLLM's shorthand
            url, url_param = value, f"{where}.image_url"
        else:
            raise RequestError(f"{where}.image_url must be an object {{url, detail}} or a URL string, got "
                               f"{json_type(value)}", f"{where}.image_url")
        detail_param = f"{where}.image_url.detail"
    else:
        url, file_id, detail = part.get("image_url"), part.get("file_id"), part.get("detail")
        url_param, detail_param = f"{where}.image_url", f"{where}.detail"
        if (url is None) == (file_id is None):
            raise RequestError(f"{where}: an input_image part needs exactly one of image_url (a URL) and file_id "
                               "(an uploaded file's id)", where)
    if detail is not None and detail not in DETAILS:
        raise RequestError(f"{detail_param} must be one of {', '.join(DETAILS)}, got {str(detail)[:40]!r}",
                           detail_param)
    detail = detail or "auto"
    if file_id is not None:
        if not isinstance(file_id, str) or not file_id.strip():
            raise RequestError(f"{where}.file_id must be a file id string, got {json_type(file_id)}",
                               f"{where}.file_id")
        return ImageRef("file", file_id, detail, where)
    if not isinstance(url, str):
        raise RequestError(f"{url_param} must be a string (a data: or http(s) URL), got {json_type(url)}", url_param)
    scheme = url[:11].lower()
    if scheme.startswith("data:"):
        return ImageRef("data", url, detail, where)
    if scheme.startswith(("http://", "https://")):
        if len(url) > MAX_URL_CHARS:
            raise RequestError(f"{url_param} is {len(url)} characters long; an image URL may have at most "
                               f"{MAX_URL_CHARS}", url_param, INVALID_IMAGE)
        return ImageRef("url", url, detail, where)
    shown = url.split(":", 1)[0][:20] if ":" in url else url[:20]
    raise RequestError(f"{url_param} must be a data: URL (data:image/png;base64,...) or an http(s) URL, got "
                       f"{shown!r}...", url_param, INVALID_IMAGE)


def template_content(content: list[Any], where: str, allow_images: bool) -> str | list[dict[str, Any]]:
    """A message's content parts as its chat template takes them: one string when they are all
    text, else the parts with each image as `{"type": "image"}`. The image parts themselves were
    checked by `image_refs` (each field once); here they only take their place. `allow_images`:
    False for a text-only model (an image part is then a 400 saying so)."""
    parts: list[dict[str, Any]] = []
    has_image = False
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PART_TYPES:
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{at}: a text part needs its text as a string, got {json_type(text)}", f"{at}.text")
            parts.append({"type": "text", "text": text})
        elif kind in IMAGE_PART_TYPES:
            if not allow_images:
                raise RequestError(f"{at}: this model takes no images (it is a text-only model): send text only, "
                                   "or send the images to a vision model", at, IMAGES_NOT_SUPPORTED)
            parts.append({"type": "image"})
            has_image = True
        else:
            shown = repr(kind)[:60] if kind is not None else json_type(part)
            raise RequestError(f"{at}: a {shown} part is not supported: send text parts and image_url parts",
                               f"{at}.type" if isinstance(part, dict) else at)
    if not has_image:
        return "".join(p["text"] for p in parts)
    return parts


def image_count(content: Any) -> int:
    """The image parts of a message's content as template_content gave it."""
    return sum(1 for part in content if part.get("type") == "image") if isinstance(content, list) else 0


def image_refs(messages: Any, root: str = "messages") -> list[ImageRef]:
    """The images a chat body's messages (or a Responses body's input items, `root` "input") name,
    in prompt order (their parts checked: 400s). Only the image parts are looked at here; the rest
    of each message is checked by the prompt."""
    refs: list[ImageRef] = []
    if not isinstance(messages, list):
        return refs
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if is_image_part(part):
                refs.append(image_ref(part, f"{root}[{i}].content[{j}]"))
    return refs


def check_image_count(refs: list[ImageRef], limits: dict[str, int]) -> None:
    """At most the `image` limit of REIN_LIMIT_MM_PER_PROMPT (400 naming it)."""
    limit = limits.get("image")
    if limit is not None and len(refs) > limit:
        param = refs[limit].param
        raise RequestError(f"the request holds {len(refs)} images; this deployment takes at most {limit} per "
                           f"request (REIN_LIMIT_MM_PER_PROMPT / --limit-mm-per-prompt image={limit}): send fewer "
                           "images, or split the request", param, INVALID_IMAGE)


def may_hold_images(body: Any) -> bool:
    """A cheap look for image parts in a chat body's messages or a Responses body's input (the
    API validates such a request off its event loop: its images are fetched and decoded)."""
    if not isinstance(body, dict):
        return False
    for key in ("messages", "input"):
        items = body.get(key)
        if isinstance(items, list):
            for item in items:
                content = item.get("content") if isinstance(item, dict) else None
                if isinstance(content, list) and any(is_image_part(part) for part in content):
                    return True
    return False


@dataclass
class PromptImages:
    """A vision model's processor (rein.model.vision.processor.VisionProcessor: `expand(text,
    images, details)`) and one request's images, opened (PIL), in prompt order, with the detail
    asked for each: what rein.openai.prompts.chat_prompt expands the placeholders with."""

    processor: Any
    images: list[Any]
    details: list[str]


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (ImageError when it is not one, or holds more
    than `max_bytes`: judged from the base64's length, before it is decoded)."""
    match = _DATA_URL.match(url)
    if match is None:
        raise ImageError("the data URL is malformed: write data:image/png;base64,<the image in base64>")
    media_type = match.group("type").strip().lower()
    params = [p.strip().lower() for p in match.group("params").split(";") if p.strip()]
    if "base64" not in params:
        raise ImageError("the data URL must be base64-encoded: data:image/png;base64,...")
    if media_type and not media_type.startswith("image/"):
        raise ImageError(f"the data URL holds {media_type!r}, not an image (data:image/png;base64,...)")
    payload = url[match.end():]
    # Every 4 base64 characters are 3 bytes: a payload this long is too large whatever it holds.
    if (len(payload.rstrip("=")) * 3) // 4 > max_bytes:
        raise ImageError(f"the image in the data URL is about {len(payload) * 3 // 4:,} bytes; the limit is "
                         f"{max_bytes:,} bytes (REIN_MAX_IMAGE_BYTES): send a smaller or more compressed image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data URL's base64 does not decode ({exc})") from None


def image_parts(messages: list[Any], max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> tuple[list[Any], list[ImageInput]]:
    """For `rein.LLM.chat` (no service, no file store, no fetching): the messages with each image
    part as `{"type": "image"}` and the images, decoded from their data URLs, in order. ImageError
    (naming the part) for a malformed part, or one that is not a data URL."""
    out = []
    try:
        refs = image_refs(messages)
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list) or not any(is_image_part(p) for p in content):
                out.append(message)
                continue
            out.append({**message, "content": template_content(content, f"messages[{i}]", True)})
    except RequestError as exc:
        raise ImageError(exc.message, param=exc.param) from None
    return out, [ImageInput.of(data_url_image(ref, max_bytes), ref.detail) for ref in refs]


def data_url_image(ref: ImageRef, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The bytes of an image given as a data URL, where nothing else is taken (offline runs:
    `rein run-batch`, `rein.LLM`); ImageError naming the part otherwise."""
    if ref.kind != "data":
        raise ImageError(f"{ref.param}: only data: URLs (data:image/png;base64,...) are taken here; "
                         "http(s) URLs and file ids are the API's", param=ref.param)
    try:
        return decode_data_url(ref.value, max_bytes)
    except ImageError as exc:
        raise ImageError(f"{ref.param}: {exc.message}", param=ref.param) from None


DATA_URL_KEPT_AS = "data:omitted;sha256="


def without_image_data(body: Any) -> Any:
    """The body as a job keeps it (params["body"]): each data-URL image replaced by
    `data:omitted;sha256=<hex of the URL>`, so Postgres never holds image bytes (the images are
    in the file store, named by params["images"]) while the same request still compares equal
    (an Idempotency-Key's replay). The body itself when it holds no data URL (no copy)."""
    if not isinstance(body, dict):
        return body
    copied = dict(body)
    changed = False
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        new_items = list(items)
        for i, item in enumerate(items):
            content = item.get("content") if isinstance(item, dict) else None
            if not isinstance(content, list):
                continue
            new_content = [_without_data(part) for part in content]
            if any(a is not b for a, b in zip(new_content, content, strict=True)):
                new_items[i] = {**item, "content": new_content}
                changed = True
        copied[key] = new_items
    return copied if changed else body


def _without_data(part: Any) -> Any:
    if not is_image_part(part):
        return part
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url[:5].lower() == "data:":
        return part
    kept = DATA_URL_KEPT_AS + hashlib.sha256(url.encode()).hexdigest()
    if isinstance(value, dict):
        return {**part, "image_url": {**value, "url": kept}}
    return {**part, "image_url": kept}
