"""A request's images inside the engine: where each sits in the prompt, what the encoder takes
for it, and what the prefix cache and the positions make of it.

The prompt arrives already expanded (rein.model.vision.processor.VisionProcessor.expand): each
image is a contiguous run of the model's `image_token_id`, images in prompt order. `prepare_images`
(called by `LLMEngine.add_request`) finds those runs, opens each image (rein.core.images.open_image)
and makes its encoder inputs at its detail, and refuses, as the request's error
(EngineRequestError), images on a text-only model and counts or lengths that do not match.

What a request then carries (`RequestImages`, on `Request.images`; shared by the choices of an
n > 1 request, never changed):

* `items` -- per image its prompt span [offset, offset + length), its encoder-cache key (the
  image's SHA-256 and detail: the same image sent twice is encoded once), its encoder inputs
  (held until a step has its embeddings; a request preempted and recomputing after the encoder
  cache dropped them makes them again from the image's bytes) and its `grid` for the positions
  hook.
* `key_token_ids` -- the prompt as the prefix cache keys it (rein.engine.block_pool keys blocks by
  their exact tokens): each image position holds a negative value derived from the image's key
  (no real token id is negative), so two prompts that differ only in their image never share a
  block, and the same image behind the same text does.
* `mrope_positions` / `mrope_delta` -- for an M-RoPE model (Qwen2-VL), the prompt's [3, n]
  positions and the offset later tokens add to their index (VisionLanguageModel.mrope_positions).

Torch is imported only for the positions (the model's hook makes them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rein.core.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, ImageInput, open_image
from rein.engine.errors import EngineRequestError

if TYPE_CHECKING:
    import torch

    from rein.model.vision.processor import VisionProcessor


@dataclass(frozen=True)
class ImageItem:
    """One image of a request: positions [offset, offset + length) of its prompt hold its tokens.

    `pixel_inputs` (the encoder's inputs, a dict of CPU tensors: 24 MB for a 1280-token Qwen2-VL
    image) are held only until a step has the image's embeddings (`release`, by the model runner);
    a recompute that finds the encoder cache without them makes them again from the image
    (`inputs`, through `reload`)."""

    offset: int
    length: int
    key: str                              # encoder-cache key: sha256 + ":" + detail
    pixel_inputs: dict[str, Any] = field(repr=False, hash=False, compare=False)
    grid: Any = None                      # the positions hook's input (Qwen2-VL: (t, h, w))
    reload: Callable[[], dict[str, Any]] | None = field(default=None, repr=False, hash=False, compare=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def inputs(self) -> dict[str, Any]:
        """The encoder's inputs for this image, made again if they were released."""
        if not self.pixel_inputs and self.reload is not None:
            self.pixel_inputs.update(self.reload())
        return self.pixel_inputs

    def release(self) -> None:
        """Drop the encoder's inputs (the image's embeddings are in the encoder cache)."""
        if self.reload is not None:
            self.pixel_inputs.clear()


@dataclass(frozen=True)
class RequestImages:
    items: tuple[ImageItem, ...]
    key_token_ids: tuple[int, ...]
    mrope_positions: Any = None           # torch.Tensor [3, prompt_len] (int64, CPU) or None
    mrope_delta: int = 0

    def overlapping(self, start: int, end: int) -> list[ImageItem]:
        """The images with a token in positions [start, end)."""
        return [item for item in self.items if item.offset < end and item.end > start]


def image_key(image: ImageInput) -> str:
    return f"{image.sha256}:{image.detail}"


def key_value(key: str) -> int:
    """The negative stand-in token an image's positions hold in the prefix cache's keys: 60 bits
    of its key's hash (SHA-256 already, hashed again with the detail)."""
    import hashlib

    return -1 - int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % (1 << 60)


def image_spans(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """The runs of `image_token_id` in the prompt, as (offset, length), in order."""
    spans: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(token_ids):
        if token == image_token_id:
            if start is None:
                start = i
        elif start is not None:
            spans.append((start, i - start))
            start = None
    if start is not None:
        spans.append((start, len(token_ids) - start))
    return spans


def prepare_images(token_ids: list[int], images: list[ImageInput], model: Any,
                   processor: VisionProcessor | None, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> RequestImages:
    """The request's images as the engine keeps them (the module docstring); EngineRequestError
    when the model takes no images, an image cannot be read, or the prompt's image-token runs do
    not match the images in number or length."""
    from rein.model.vision.base import is_vision_model

    if processor is None or not is_vision_model(model):
        raise EngineRequestError("this model takes text only: the request has images; send it to a vision "
                                 "model (Qwen2-VL, Qwen2.5-VL, ...) or drop the image parts", param="messages")
    for image in images:
        if not isinstance(image, ImageInput):
            raise EngineRequestError(f"images must be ImageInput values (rein.core.images), got "
                                     f"{type(image).__name__}", param="messages")
    spans = image_spans(token_ids, model.image_token_id)
    if len(spans) != len(images):
        raise EngineRequestError(
            f"the prompt holds {len(spans)} image(s) (runs of image token {model.image_token_id}) but the request "
            f"has {len(images)} image(s): expand the prompt with the model's processor "
            f"(VisionProcessor.expand), one placeholder per image", param="messages")
    items = []
    for index, (image, (offset, length)) in enumerate(zip(images, spans, strict=True)):
        try:
            pixels = processor.pixel_inputs(open_image(image.data, max_pixels=max_pixels), image.detail)
        except ImageError as exc:
            raise EngineRequestError(f"image {index}: {exc}", param="messages") from exc
        tokens = processor.tokens_of(pixels)
        if tokens != length:
            raise EngineRequestError(
                f"image {index} takes {tokens} tokens at detail {image.detail!r}, but the prompt holds {length} "
                f"image tokens for it: expand the prompt with the model's processor at the same detail",
                param="messages")
        items.append(ImageItem(offset, length, image_key(image), pixels, processor.grid(pixels),
                               functools.partial(_pixel_inputs, processor, image, max_pixels)))
    keys = list(token_ids)
    for item in items:
        value = key_value(item.key)
        keys[item.offset:item.end] = [value] * item.length
    mrope = model.mrope_positions(token_ids, [item.grid for item in items])
    positions, delta = mrope if mrope is not None else (None, 0)
    return RequestImages(tuple(items), tuple(keys), positions, int(delta))


def _pixel_inputs(processor: VisionProcessor, image: ImageInput, max_pixels: int) -> dict[str, Any]:
    return processor.pixel_inputs(open_image(image.data, max_pixels=max_pixels), image.detail)


def step_positions(images: RequestImages | None, start: int, end: int) -> torch.Tensor | None:
    """The [3, end - start] M-RoPE positions of positions [start, end) of a request (prompt
    positions from its table, later ones index + delta on all three axes); None when the request
    has plain positions (no images, or a model without M-RoPE)."""
    if images is None or images.mrope_positions is None:
        return None
    import torch

    table = images.mrope_positions
    prompt_len = table.shape[1]
    if end <= prompt_len:
        return table[:, start:end]
    parts = []
    if start < prompt_len:
        parts.append(table[:, start:])
    later = torch.arange(max(start, prompt_len), end, dtype=table.dtype) + images.mrope_delta
    parts.append(later.expand(3, -1))
    return torch.cat(parts, dim=1)
