"""The image encoders of LLaVA, Idefics3 / SmolVLM and Gemma 3: an image's encoder inputs in, the
rows that replace its placeholder tokens' embeddings out, one tensor [tokens, text hidden] per
image, computed as each family's `get_image_features` in transformers computes them (their
own modules: rein.model.vision.hf_parts).

* LLaVA: the CLIP (or SigLIP) tower's hidden states of `vision_feature_layer` (one layer, or
  several concatenated), the CLS position dropped under the "default" strategy, through the
  two-layer GeLU projector. One 2-D image per request image.
* Idefics3 / SmolVLM: each tile (the image's split tiles and its global view) through the
  SigLIP-like tower, masked where the tile was padded, pixel-shuffled and projected by the
  connector: `image_seq_len` rows per tile, tiles in the order the prompt holds them.
* Gemma 3: SigLIP's last hidden state, average-pooled to `mm_tokens_per_image` positions,
  RMS-normed (1 + w) and projected.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rein.model.spec import UnsupportedModelError
from rein.model.vision.hf_parts import build_module, load_module

# LLaVA's towers rein runs: one image of one resolution each (Pixtral's tower takes any size
# and needs Mistral's 2-D rope per image: a LLaVA config with it is refused).
LLAVA_TOWERS = ("clip_vision_model", "siglip_vision_model")


class LlavaEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        tower = config.vision_config.model_type
        if tower not in LLAVA_TOWERS:
            raise UnsupportedModelError(
                f"LLaVA with a {tower!r} vision tower is not supported: rein runs LLaVA with "
                f"{' or '.join(LLAVA_TOWERS)} (one fixed image resolution)")
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)
        self.feature_layers = ([config.vision_feature_layer] if isinstance(config.vision_feature_layer, int)
                               else list(config.vision_feature_layer))
        self.drop_cls = config.vision_feature_select_strategy == "default"

    def forward(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = torch.cat([p["pixel_values"] for p in pixel_inputs]).to(self.dtype)
        hidden = self.vision_tower(pixels, output_hidden_states=True, return_dict=True).hidden_states
        picked = [hidden[layer][:, 1:] if self.drop_cls else hidden[layer] for layer in self.feature_layers]
        return list(self.multi_modal_projector(torch.cat(picked, dim=-1)))

    @property
    def dtype(self) -> torch.dtype:
        return self.multi_modal_projector.linear_1.weight.dtype

    def load(self, get) -> None:
        load_module(self.vision_tower, get, ("model.vision_tower.", "vision_tower."), "LLaVA vision tower")
        load_module(self.multi_modal_projector, get, ("model.multi_modal_projector.", "multi_modal_projector."),
                    "LLaVA projector")


class Idefics3Encoder(nn.Module):
    """Idefics3 and SmolVLM (the same tower and connector; SmolVLM's classes are Idefics3's
    under another name)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.model_type == "smolvlm":
            from transformers.models.smolvlm.modeling_smolvlm import SmolVLMConnector as Connector
            from transformers.models.smolvlm.modeling_smolvlm import (
                SmolVLMVisionTransformer as Tower,
            )
        else:
            from transformers.models.idefics3.modeling_idefics3 import (
                Idefics3Connector as Connector,
            )
            from transformers.models.idefics3.modeling_idefics3 import (
                Idefics3VisionTransformer as Tower,
            )
        self.vision_model = Tower._from_config(config.vision_config)
        self.connector = Connector(config)
        self.patch_size = config.vision_config.patch_size

    def forward(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's rows: its tiles' `image_seq_len` rows each, tile after tile."""
        dtype = self.connector.modality_projection.proj.weight.dtype
        # Tiles of different images may differ in size: padded (masked off) to the largest, as
        # transformers' processor pads a batch.
        height = max(p["pixel_values"].shape[-2] for p in pixel_inputs)
        width = max(p["pixel_values"].shape[-1] for p in pixel_inputs)
        pixels = torch.cat([_pad(p["pixel_values"], height, width) for p in pixel_inputs]).to(dtype)
        mask = torch.cat([_pad(p["pixel_attention_mask"], height, width) for p in pixel_inputs])
        # A tile's patch takes part where any of its pixels is real (not the processor's padding).
        patches = mask.unfold(1, self.patch_size, self.patch_size).unfold(2, self.patch_size, self.patch_size)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).bool()
        hidden = self.vision_model(pixel_values=pixels, patch_attention_mask=patch_mask,
                                   return_dict=True).last_hidden_state
        features = self.connector(hidden)
        tiles = [p["pixel_values"].shape[0] for p in pixel_inputs]
        return [f.reshape(-1, f.shape[-1]) for f in features.split(tiles)]

    def load(self, get) -> None:
        load_module(self.vision_model, get, ("model.vision_model.",), "Idefics3 vision tower")
        load_module(self.connector, get, ("model.connector.",), "Idefics3 connector")


def _pad(tensor: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """`tensor` [..., h, w] padded with zeros (False) at the bottom and right to height x width."""
    h, w = tensor.shape[-2:]
    if (h, w) == (height, width):
        return tensor
    return nn.functional.pad(tensor, (0, width - w, 0, height - h))


class Gemma3Encoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(config)

    def forward(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        pixels = torch.cat([p["pixel_values"] for p in pixel_inputs]).to(dtype)
        hidden = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(hidden))

    def load(self, get) -> None:
        load_module(self.vision_tower, get, ("model.vision_tower.", "vision_tower."), "Gemma 3 vision tower")
        load_module(self.multi_modal_projector, get, ("model.multi_modal_projector.", "multi_modal_projector."),
                    "Gemma 3 projector")


ENCODERS = {"llava": LlavaEncoder, "idefics3": Idefics3Encoder, "smolvlm": Idefics3Encoder,
            "gemma3": Gemma3Encoder}


def make_encoder(config: Any, dtype: torch.dtype, device: torch.device, get) -> nn.Module:
    """The family's encoder for the transformers `config`, loaded from the checkpoint getter `get`."""
    encoder = build_module(lambda: ENCODERS[config.model_type](config), dtype, device)
    encoder.load(get)
    return encoder
