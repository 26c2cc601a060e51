"""The prompt side of LLaVA, Idefics3 / SmolVLM and Gemma 3 (rein.model.vision.processor's
VisionProcessor): how a placeholder expands and what the encoder takes, as each family's
transformers processor does it.

* LLaVA: `<image>` becomes `<image>` x N, N = the tower's patches (+ its CLS, less one under
  the "default" feature strategy). One resolution: `detail` is ignored.
* Idefics3 / SmolVLM: the image is resized and split into tiles of the tower's size (rows x
  cols, plus the whole image shrunk to one tile); `<image>` becomes, per tile,
  `<fake_token_around_image><row_r_col_c>` + `<image>` x image_seq_len, a newline after each
  row, then `\\n<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
  `<fake_token_around_image>`. An image's `<image>` tokens are therefore not one run: the
  engine's span of the image is the whole expansion, from its first `<fake_token_around_image>`
  to its last (`image_spans`), and the encoder returns a row for every position of it (the
  tile-marker tokens' own embeddings where they stand). The encoder inputs carry the span's
  token ids (`span_token_ids`) for that. `detail: "low"` turns splitting off (the global tile
  only: 1/(rows*cols+1) of the tokens); "auto" and "high" split as the processor is set.
* Gemma 3: `<start_of_image>` becomes `\\n\\n<start_of_image>` + `<image_soft_token>` x
  mm_tokens_per_image + `<end_of_image>\\n\\n`. One resolution (pan-and-scan off, its default):
  `detail` is ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rein.core.images import ImageError
from rein.model.spec import UnsupportedModelError
from rein.model.vision.family_spec import UNSUPPORTED, unsupported_reason
from rein.model.vision.processor import (
    ExpandedPrompt,
    VisionProcessor,
    _details,
    split_at_placeholders,
)

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image


class LlavaVisionProcessor(VisionProcessor):
    def __init__(self, image_processor: Any, tokenizer: Any, model_type: str, config: dict[str, Any],
                 settings: dict[str, Any]) -> None:
        super().__init__(image_processor, tokenizer, model_type)
        vision = config.get("vision_config") or {}
        self._image_token_id = int(config.get("image_token_index", config.get("image_token_id", 32000)))
        self.placeholder = settings.get("image_token") or tokenizer.convert_ids_to_tokens(self._image_token_id)
        self.patch_size = int(settings.get("patch_size") or vision.get("patch_size") or 14)
        # CLIP's tower adds a CLS position, SigLIP's none (the processor's setting when it has one).
        cls_token = vision.get("model_type", "clip_vision_model") == "clip_vision_model"
        self.extra = int(settings.get("num_additional_image_tokens", int(cls_token)))
        strategy = settings.get("vision_feature_select_strategy") or config.get("vision_feature_select_strategy")
        self.drop_cls = (strategy or "default") == "default"
        self._fixed_count: int | None = None

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def count_tokens(self, image: Image, detail: str = "auto") -> int:
        """Every image takes the same count when the image processor ends at one size (a center
        crop, or a fixed height x width): worked out once, from the first image."""
        ip = self.image_processor
        size = getattr(ip, "size", None) or {}
        fixed = (getattr(ip, "do_center_crop", False) and getattr(ip, "crop_size", None)) or "height" in size
        if not fixed:
            return super().count_tokens(image, detail)
        if self._fixed_count is None:
            self._fixed_count = super().count_tokens(image, detail)
        return self._fixed_count

    def tokens_of(self, pixel_inputs: dict[str, torch.Tensor]) -> int:
        height, width = pixel_inputs["pixel_values"].shape[-2:]
        return (height // self.patch_size) * (width // self.patch_size) + self.extra - int(self.drop_cls)

    def replacement(self, num_tokens: int) -> str:
        return self.placeholder * num_tokens

    def pixel_inputs(self, image: Image, detail: str = "auto") -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}


class Idefics3VisionProcessor(VisionProcessor):
    FAKE = "<fake_token_around_image>"
    GLOBAL = "<global-img>"

    def __init__(self, image_processor: Any, tokenizer: Any, model_type: str, config: dict[str, Any],
                 settings: dict[str, Any]) -> None:
        super().__init__(image_processor, tokenizer, model_type)
        self._image_token_id = int(config.get("image_token_id", 128257))
        self.image_token = tokenizer.convert_ids_to_tokens(self._image_token_id)
        self.placeholder = self.image_token
        vision = config.get("vision_config") or {}
        patches = (int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))) ** 2
        self.image_seq_len = int(settings.get("image_seq_len") or patches // int(config.get("scale_factor", 2)) ** 2)
        self.splitting = bool(getattr(image_processor, "do_image_splitting", True))
        self.fake_token_id = int(tokenizer.convert_tokens_to_ids(self.FAKE))
        self.global_token_id = int(tokenizer.convert_tokens_to_ids(self.GLOBAL))
        self.first_tile_id = int(tokenizer.convert_tokens_to_ids("<row_1_col_1>"))

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def image_spans(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """Each image's (offset, length) in an expanded prompt: from the marker that opens its
        first tile (or its global tile) to the marker that closes its global tile. An `<image>`
        run outside any such span counts as a span of its own, so that the engine's check of
        spans against images refuses the prompt."""
        fake, image, n = self.fake_token_id, self._image_token_id, len(token_ids)
        opening = (self.global_token_id, self.first_tile_id)
        spans: list[tuple[int, int]] = []
        covered = 0
        i = 0
        while i < n:
            if token_ids[i] == fake and i + 1 < n and token_ids[i + 1] in opening:
                try:
                    glob = token_ids.index(self.global_token_id, i + 1)
                except ValueError:
                    break
                end = glob + 1 + self.image_seq_len   # the closing marker
                if end < n and token_ids[end] == fake and all(t == image for t in token_ids[glob + 1:end]):
                    spans.append((i, end + 1 - i))
                    covered += sum(t == image for t in token_ids[i:end + 1])
                    i = end + 1
                    continue
            i += 1
        if covered != sum(t == image for t in token_ids):
            inside = {p for offset, length in spans for p in range(offset, offset + length)}
            stray = [p for p, t in enumerate(token_ids) if t == image and p not in inside]
            strays = set(stray)
            for p in stray:
                if p - 1 not in strays:
                    spans.append((p, 1))
                else:
                    offset, length = spans[-1]
                    spans[-1] = (offset, length + 1)
            spans.sort()
        return spans

    def image_text(self, rows: int, cols: int) -> str:
        """The expansion of one image of rows x cols tiles (0 x 0: not split), as transformers'."""
        tile = self.image_token * self.image_seq_len
        whole = f"{self.FAKE}{self.GLOBAL}{tile}{self.FAKE}"
        if rows == 0 and cols == 0:
            return whole
        text = "".join("".join(f"{self.FAKE}<row_{r + 1}_col_{c + 1}>{tile}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return text + "\n" + whole

    def _tiles(self, image: Image, detail: str) -> tuple[Any, int, int]:
        """The image processor's output for `image` at `detail`, and its rows and cols of tiles."""
        split = self.splitting and detail != "low"
        try:
            out = self.image_processor(images=[[image]], return_tensors="pt", do_image_splitting=split,
                                       return_row_col_info=True)
        except ValueError as exc:
            raise ImageError(f"the image cannot be taken: {exc}") from None
        return out, int(out["rows"][0][0]), int(out["cols"][0][0])

    def _grid(self, image: Image, detail: str) -> tuple[int, int]:
        """The image's rows and cols of tiles, from its size alone where the image processor can
        tell (transformers' own count), else by preprocessing it."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is not None:
            width, height = image.size
            try:
                _, rows, cols = count(height, width, {"do_image_splitting": self.splitting and detail != "low"})
                return int(rows), int(cols)
            except (TypeError, KeyError, ValueError):
                pass
        _, rows, cols = self._tiles(image, detail)
        return rows, cols

    def pixel_inputs(self, image: Image, detail: str = "auto") -> dict[str, torch.Tensor]:
        import torch

        out, rows, cols = self._tiles(image, detail)
        ids = self.tokenizer(self.image_text(rows, cols), add_special_tokens=False)["input_ids"]
        pixels = out["pixel_values"][0]
        mask = out.get("pixel_attention_mask")
        mask = torch.ones(pixels.shape[0], *pixels.shape[-2:], dtype=torch.bool) if mask is None else mask[0]
        return {"pixel_values": pixels, "pixel_attention_mask": mask,
                "span_token_ids": torch.tensor(ids, dtype=torch.long)}

    def tokens_of(self, pixel_inputs: dict[str, torch.Tensor]) -> int:
        return int(pixel_inputs["span_token_ids"].shape[0])

    def count_tokens(self, image: Image, detail: str = "auto") -> int:
        """The image's span length, from its size (no preprocessing)."""
        return self._length(self.image_text(*self._grid(image, detail)))

    def _length(self, expansion: str) -> int:
        return len(self.tokenizer(expansion, add_special_tokens=False)["input_ids"])

    def expand(self, text: str, images: list[Image], details: list[str] | None = None) -> ExpandedPrompt:
        """As VisionProcessor.expand, each image's expansion depending on its tiles; the counts are
        the images' spans (their whole expansion, tile markers included: what the engine holds)."""
        details = _details(details, len(images))
        pieces = split_at_placeholders(text, self.placeholder, len(images))
        out, counts = [pieces[0]], []
        for image, detail, piece in zip(images, details, pieces[1:], strict=True):
            expansion = self.image_text(*self._grid(image, detail))
            counts.append(self._length(expansion))
            out += [expansion, piece]
        ids = self.tokenizer("".join(out), add_special_tokens=False)["input_ids"]
        return ExpandedPrompt([int(t) for t in ids], counts)


class Gemma3VisionProcessor(VisionProcessor):
    def __init__(self, image_processor: Any, tokenizer: Any, model_type: str, config: dict[str, Any],
                 settings: dict[str, Any]) -> None:
        super().__init__(image_processor, tokenizer, model_type)
        self._image_token_id = int(config.get("image_token_index", 262144))
        self.image_token = tokenizer.convert_ids_to_tokens(self._image_token_id)
        self.placeholder = tokenizer.convert_ids_to_tokens(int(config.get("boi_token_index", 255999)))
        self.eoi_token = tokenizer.convert_ids_to_tokens(int(config.get("eoi_token_index", 256000)))
        self.image_seq_length = int(settings.get("image_seq_length") or config.get("mm_tokens_per_image", 256))

    @property
    def image_token_id(self) -> int:
        return self._image_token_id

    def tokens_of(self, pixel_inputs: dict[str, torch.Tensor]) -> int:
        return self.image_seq_length

    def count_tokens(self, image: Image, detail: str = "auto") -> int:
        return self.image_seq_length

    def replacement(self, num_tokens: int) -> str:
        return f"\n\n{self.placeholder}{self.image_token * num_tokens}{self.eoi_token}\n\n"

    def pixel_inputs(self, image: Image, detail: str = "auto") -> dict[str, torch.Tensor]:
        out = self.image_processor(images=[image], return_tensors="pt", do_pan_and_scan=False)
        return {"pixel_values": out["pixel_values"]}


PROCESSORS: dict[str, type[VisionProcessor]] = {"llava": LlavaVisionProcessor, "idefics3": Idefics3VisionProcessor,
              "smolvlm": Idefics3VisionProcessor, "gemma3": Gemma3VisionProcessor}

def load_family_processor(model_dir: Path, model_type: str | None, tokenizer: Any = None) -> VisionProcessor | None:
    """The processor of a LLaVA, Idefics3 / SmolVLM or Gemma 3 model directory (None for another
    model_type); its settings from processor_config.json where present, else from config.json."""
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(unsupported_reason(model_type))
    cls = PROCESSORS.get(model_type)
    if cls is None:
        return None
    from transformers import AutoImageProcessor, AutoTokenizer

    config = json.loads((model_dir / "config.json").read_text())
    settings_path = model_dir / "processor_config.json"
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return cls(AutoImageProcessor.from_pretrained(str(model_dir)), tokenizer, model_type, config, settings)
