"""LLaVA (1.5-style: one image resolution): rein's native Llama-family text model and the
CLIP / SigLIP tower with LLaVA's MLP projector (rein.model.vision.encoders.LlavaEncoder).

An image is a run of `<image>` tokens whose embeddings are the projector's rows, attending
causally like text: any chunk may cut it. Checkpoint layouts: transformers 5's
`model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`,
and the older `language_model.model.*`, `language_model.lm_head.*`, `vision_tower.*`,
`multi_modal_projector.*`. LLaVA-NeXT / OneVision (any-resolution tiles) are other model types,
refused by the processor's loader with the reason (rein.model.vision.family_processors).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rein.model.architectures.llama import LlamaFamilyModel
from rein.model.architectures.weights import TensorGetter
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.spec import ModelSpec
from rein.model.vision.encoders import make_encoder
from rein.model.vision.hf_parts import hf_config, text_getter


class LlavaModel(LlamaFamilyModel):
    """See the module docstring; implements rein.model.vision.base.VisionLanguageModel. The
    Idefics3 / SmolVLM model is this one with its own checkpoint names and spans
    (rein.model.vision.idefics3)."""

    image_tokens_whole_chunk = False
    # Where the checkpoint keeps the text model and its head, most recent layout first.
    text_prefixes: tuple[str, ...] = ("model.language_model.", "language_model.model.")
    head_names: tuple[str, ...] = ("lm_head.weight", "language_model.lm_head.weight")

    def __init__(self, spec: ModelSpec, max_positions: int, group: ParallelGroup = SINGLE_RANK) -> None:
        if group.world_size > 1:   # before building a model of the wrong width
            raise ValueError("vision models run on one rank: use tensor_parallel_size 1")
        super().__init__(spec, max_positions, group)
        self.hf_config = hf_config(spec.vision_config)
        self.image_token_id = int(self.hf_config.image_token_id)
        self.encoder: nn.Module | None = None   # built in load_hf_weights, where the device is known

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def mrope_positions(self, token_ids: list[int], image_grids: list[Any]) -> None:
        return None   # plain 1-D positions

    def encode_images(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        dtype = self.embed_tokens.weight.dtype
        return [rows.to(dtype) for rows in self.encoder(pixel_inputs)]

    def load_hf_weights(self, get: TensorGetter) -> None:
        """The text model under rein's names (rein.model.vision.hf_parts.text_getter), then the
        encoder on the text model's device and dtype."""
        super().load_hf_weights(text_getter(get, self.text_prefixes, self.head_names))
        weight = self.embed_tokens.weight
        self.encoder = make_encoder(self.hf_config, weight.dtype, weight.device, get)
