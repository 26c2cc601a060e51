"""Idefics3 and SmolVLM: rein's native Llama text model and their SigLIP-like tower with the
pixel-shuffle connector (rein.model.vision.encoders.Idefics3Encoder).

An image is split into tiles, and its expansion interleaves tile markers with the tiles'
`<image>` runs (rein.model.vision.family_processors.Idefics3VisionProcessor). The engine holds
an image as one span, from its first `<fake_token_around_image>` to its last (the processor's
`image_spans`); `encode_images` returns a row for every position of that span: the connector's rows at the
`<image>` positions, the markers' own token embeddings between them (the span's token ids come
with the encoder inputs), which is exactly what transformers' merge leaves there. Attention is
causal throughout, as in transformers: any chunk may cut an image.

Checkpoint layout (both transformers 4 and 5): `model.text_model.*`, `model.vision_model.*`,
`model.connector.*`, `lm_head.*`.
"""

from __future__ import annotations

import torch

from rein.model.vision.llava import LlavaModel


class Idefics3Model(LlavaModel):
    """See the module docstring; implements rein.model.vision.base.VisionLanguageModel."""

    text_prefixes = ("model.text_model.",)
    head_names = ("lm_head.weight",)

    def encode_images(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        rows = super().encode_images(pixel_inputs)
        out = []
        for inputs, features in zip(pixel_inputs, rows, strict=True):
            ids = inputs["span_token_ids"].to(self.embed_tokens.weight.device)
            span = self.embed_tokens(ids)
            span[ids == self.image_token_id] = features
            out.append(span)
        return out
