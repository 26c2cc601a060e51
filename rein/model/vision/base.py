"""What a vision-language model is to rein's engine: the protocol every family implements.

The engine (rein.engine.multimodal, the scheduler and the model runner) drives a VLM through
these members only, so a family plugs in by implementing them (Qwen2-VL here; LLaVA, Idefics3,
Gemma 3 beside it):

* `image_token_id` -- the token id whose positions in the (already expanded) prompt hold an
  image's embeddings. Every image is a contiguous run of it, images in prompt order.
* `image_tokens_whole_chunk` -- True when an image's tokens must be computed in one prefill
  chunk (their attention is bidirectional among themselves: Gemma 3); the scheduler then never
  cuts a chunk inside an image. False (Qwen2-VL, LLaVA): any split is fine once the image's
  embeddings are cached.
* `encode_images(pixel_inputs)` -- run the vision tower (and projector) on one or more images,
  each given as the dict `VisionProcessor.pixel_inputs` made for it (tensors on the model's
  device), and return one tensor [tokens_i, hidden] per image, in the text model's dtype, where
  tokens_i is the image's count of `image_token_id` tokens in the prompt.
* `embed_input_ids(input_ids)` -- the text embeddings [T, hidden] the first decoder layer takes
  (with any scaling the family applies to text embeddings: Gemma 3's sqrt(hidden)). The runner
  overwrites the image positions' rows with `encode_images`' output and passes the result as
  `inputs_embeds`.
* `forward(input_ids, positions, caches, meta, inputs_embeds=None)` -- the usual native-model
  forward; with `inputs_embeds` it skips the embedding lookup. `positions` is [T] for ordinary
  rope, or [3, T] (t, h, w) for a model with M-RoPE when a step holds image positions.
* `mrope_positions(token_ids, image_grids)` -- the positions hook: None for a model with plain
  1-D positions; for M-RoPE (Qwen2-VL) the prompt's [3, n] position ids and the delta
  (max position + 1 - n) that later tokens add to their index, as transformers'
  `get_rope_index` computes them. `image_grids` are the images' `grid` values
  (rein.engine.multimodal.ImageItem.grid: for Qwen2-VL its (t, h, w) patch grid).

A text-only model has none of these; `is_vision_model(model)` tells them apart.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class VisionLanguageModel(Protocol):
    image_token_id: int
    image_tokens_whole_chunk: bool

    def encode_images(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]: ...

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def mrope_positions(self, token_ids: list[int], image_grids: list[Any]
                        ) -> tuple[torch.Tensor, int] | None: ...


def is_vision_model(model: Any) -> bool:
    """Whether the loaded `model` takes images (implements VisionLanguageModel)."""
    return isinstance(model, VisionLanguageModel)


def checkpoint_prefixes(get: Any, names: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """For each part of a VLM checkpoint, the key prefix this checkpoint uses: transformers 5
    saves `model.language_model.*`, `model.visual.*`, `lm_head.*`; older checkpoints `model.*`,
    `visual.*`. `names` maps a part to its candidate prefixes, most recent layout first, each
    checked by a probe tensor name appended to it; the first whose probe exists wins (the last
    candidate when none does, so the error names a real layout)."""
    found = {}
    for part, candidates in names.items():
        prefixes, probe = candidates[:-1], candidates[-1]
        found[part] = next((p for p in prefixes if get(p + probe) is not None), prefixes[-1])
    return found
