"""A vision model's prompt side: images -> the prompt's token ids and the encoder's inputs.

`load_vision_processor(model_dir)` gives the model's `VisionProcessor` (None for a text-only
model). It wraps transformers' own image processor for the family (`AutoImageProcessor`: without
torchvision transformers builds its `*ImageProcessorPil` classes, which rein uses) and the
model's tokenizer, and expands placeholders as the family's transformers processor does, so the
resizing, normalisation and token counts are exactly transformers'. (Not `AutoProcessor` itself:
the Qwen2-VL processor insists on its video processor, which needs torchvision.)

* `expand(text, images, details)` -- `text` is the prompt already through the chat template,
  holding the template's placeholder once per image (Qwen2-VL: `<|image_pad|>` between
  `<|vision_start|>` and `<|vision_end|>`). Each placeholder is replaced by that image's run
  of image tokens, exactly as the HF processor does, and the text is tokenized without adding
  special tokens (the chat template wrote them: rein tokenizes chat prompts that way). The
  token ids are what the engine takes (`LLMEngine.add_request(..., images=...)`) and what the
  context-length check counts. A count of placeholders that differs from the images is an
  ImageError.
* `pixel_inputs(image, detail)` -- the tensors the vision encoder takes for one image
  (Qwen2-VL: `pixel_values` [patches, C*T*P*P] and `image_grid_thw` [1, 3]), on the CPU.
* `detail` (OpenAI's "auto" | "low" | "high"): Qwen2-VL takes any resolution, so "low" caps the
  image at LOW_DETAIL_MAX_PIXELS (256 * 28 * 28 pixels: at most 256 image tokens, OpenAI's low
  detail being one small tile); "auto" and "high" use the processor's own limits. `expand` and
  `pixel_inputs` use the same detail, so the counts agree. A model with one resolution ignores it.

The API (h-images), `rein run-batch` and `rein.LLM` call `expand`; the engine calls
`pixel_inputs` (rein.engine.multimodal) when it prepares a request's images. Families register
their processor class in `PROCESSORS` (model_type -> class).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rein.core.images import DETAILS, ImageError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

# detail "low" on Qwen2-VL: at most this many pixels, i.e. 256 image tokens of 28 x 28 pixels.
LOW_DETAIL_MAX_PIXELS = 256 * 28 * 28


@dataclass
class ExpandedPrompt:
    """A prompt's token ids with every image placeholder expanded to its image's tokens, and
    how many tokens each image took (in prompt order)."""

    token_ids: list[int]
    image_token_counts: list[int] = field(default_factory=list)


class VisionProcessor:
    """A vision model's processor (see the module docstring). Subclasses set how an image's
    placeholder is expanded (`replacement`) and what the encoder takes (`pixel_inputs`)."""

    # The text the chat template writes for one image, which `expand` replaces.
    placeholder: str = ""

    def __init__(self, image_processor: Any, tokenizer: Any, model_type: str) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.model_type = model_type

    @property
    def image_token_id(self) -> int:
        """The token id whose runs in an expanded prompt hold the images."""
        raise NotImplementedError

    def count_tokens(self, image: Image, detail: str = "auto") -> int:
        """How many image tokens `image` takes at `detail` (without preprocessing its pixels
        where the family allows)."""
        return self.tokens_of(self.pixel_inputs(image, detail))

    def tokens_of(self, pixel_inputs: dict[str, torch.Tensor]) -> int:
        """How many image tokens the image of these encoder inputs takes."""
        raise NotImplementedError

    def grid(self, pixel_inputs: dict[str, torch.Tensor]) -> Any:
        """What the model's positions hook needs of the image (VisionLanguageModel.mrope_positions):
        None for a model with plain positions."""
        return None

    def replacement(self, num_tokens: int) -> str:
        """The text that stands for one image of `num_tokens` tokens in the expanded prompt."""
        raise NotImplementedError

    def pixel_inputs(self, image: Image, detail: str = "auto") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expand(self, text: str, images: list[Image], details: list[str] | None = None) -> ExpandedPrompt:
        """The token ids of `text` (chat-templated, one placeholder per image) with each
        placeholder expanded to its image's tokens; ImageError when placeholders and images
        differ in number (or `details` in length)."""
        details = _details(details, len(images))
        pieces = split_at_placeholders(text, self.placeholder, len(images))
        counts = [self.count_tokens(image, detail) for image, detail in zip(images, details, strict=True)]
        out = [pieces[0]]
        for count, piece in zip(counts, pieces[1:], strict=True):
            out.append(self.replacement(count))
            out.append(piece)
        ids = self.tokenizer("".join(out), add_special_tokens=False)["input_ids"]
        return ExpandedPrompt([int(t) for t in ids], counts)


class Qwen2VLProcessor(VisionProcessor):
    """Qwen2-VL and Qwen2.5-VL: any resolution, resized to multiples of 28 pixels within the
    processor's min/max pixels; an image of grid (t, h, w) patches of 14 pixels takes
    t*h*w / merge_size^2 tokens, each `<|image_pad|>`."""

    def __init__(self, image_processor: Any, tokenizer: Any, model_type: str) -> None:
        super().__init__(image_processor, tokenizer, model_type)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.placeholder = self.image_token
        self._image_token_id = int(self.tokenizer.convert_tokens_to_ids(self.image_token))
        size = self.image_processor.size
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.patch_size = int(self.image_processor.patch_size)
        self.merge_size = int(self.image_processor.merge_size)
        self.temporal_patch_size = int(self.image_processor.temporal_patch_size)

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def _pixels(self, detail: str) -> tuple[int, int]:
        """(min_pixels, max_pixels) for `detail` (the module docstring)."""
        if detail == "low":
            return min(self.min_pixels, LOW_DETAIL_MAX_PIXELS), min(self.max_pixels, LOW_DETAIL_MAX_PIXELS)
        return self.min_pixels, self.max_pixels

    def count_tokens(self, image: Image, detail: str = "auto") -> int:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        width, height = image.size
        min_pixels, max_pixels = self._pixels(detail)
        factor = self.patch_size * self.merge_size
        try:
            h, w = smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as exc:   # an aspect ratio beyond 200:1
            raise ImageError(f"the image ({width}x{height}) cannot be taken: {exc}") from None
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def tokens_of(self, pixel_inputs: dict[str, torch.Tensor]) -> int:
        return int(pixel_inputs["image_grid_thw"][0].prod()) // self.merge_size**2

    def grid(self, pixel_inputs: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        t, h, w = (int(v) for v in pixel_inputs["image_grid_thw"][0])
        return t, h, w

    def replacement(self, num_tokens: int) -> str:
        return self.image_token * num_tokens

    def pixel_inputs(self, image: Image, detail: str = "auto") -> dict[str, torch.Tensor]:
        min_pixels, max_pixels = self._pixels(detail)
        try:
            out = self.image_processor(images=[image], return_tensors="pt",
                                       size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
        except ValueError as exc:
            raise ImageError(f"the image cannot be taken: {exc}") from None
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


# config.json's model_type -> its processor class (h-vlm adds LLaVA, Idefics3, Gemma 3 here).
PROCESSORS: dict[str, type[VisionProcessor]] = {
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2VLProcessor,
}


def load_vision_processor(model_dir: str | Path, tokenizer: Any = None) -> VisionProcessor | None:
    """The vision processor of the model in `model_dir`, or None for a model that takes no
    images (its model_type is not a vision family rein runs). `tokenizer`: the one the caller
    uses already (the engine's, with --tokenizer / --chat-template applied); else the model's."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    model_type = json.loads(config_path.read_text()).get("model_type")
    cls = PROCESSORS.get(model_type)
    if cls is None:   # LLaVA, Idefics3 / SmolVLM, Gemma 3 (None for a text-only model)
        from rein.model.vision.family_processors import load_family_processor

        return load_family_processor(Path(model_dir), model_type, tokenizer)
    from transformers import AutoImageProcessor, AutoTokenizer

    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return cls(AutoImageProcessor.from_pretrained(str(model_dir)), tokenizer, model_type)


def split_at_placeholders(text: str, placeholder: str, images: int) -> list[str]:
    """`text` cut at each image placeholder (images + 1 pieces); ImageError when it holds another
    number of placeholders than `images`."""
    pieces = text.split(placeholder)
    if len(pieces) - 1 != images:
        raise ImageError(f"the prompt has {len(pieces) - 1} image placeholder(s) ({placeholder!r}) but {images} "
                         f"image(s) were given: give one image per placeholder (chat messages write one "
                         f"placeholder per image part)", param="messages")
    return pieces


def _details(details: list[str] | None, count: int) -> list[str]:
    if details is None:
        return ["auto"] * count
    if len(details) != count:
        raise ImageError(f"{len(details)} detail values were given for {count} image(s)", param="detail")
    for detail in details:
        if detail not in DETAILS:
            raise ImageError(f"detail must be one of {', '.join(DETAILS)}, got {detail!r}", param="detail")
    return list(details)

