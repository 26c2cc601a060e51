"""Qwen2-VL and Qwen2.5-VL: rein's native Qwen2 text model with M-RoPE, and transformers' own
vision tower.

Why this split: the text model is a Qwen2 decoder (q/k/v bias, RMSNorm, SiLU MLP) whose only
difference is M-RoPE, so rein's native Llama-family model runs it with the paged KV cache, fused
projections and CUDA graphs (decode steps have 1-D positions: see below) -- the fast path, and
exact against transformers since the arithmetic is the same. The vision tower runs once per image,
outside the KV cache; transformers' own module (`Qwen2VisionTransformerPretrainedModel`,
`Qwen2_5_VisionTransformerPretrainedModel`), built from the config and filled from the checkpoint,
is exact by construction and runs on any device. Its attention modules run `vision_attention`
(the same products with rein's rotary kernel), and on the CPU its linears are packed for oneDNN
(`pack_cpu_weights`).

M-RoPE: the rotary frequencies are split in three sections (`mrope_section`), rotated by a
token's temporal, height and width position. Text tokens have the same position on all three,
which is ordinary rope, so only prefill chunks of prompts with images take [3, T] positions
(`positions` of the forward); every decode step's position is index + the request's delta, 1-D.
`mrope_positions` computes a prompt's positions and delta as transformers' `get_rope_index` does
for images.

Checkpoint keys: transformers 5 saves `model.language_model.*`, `model.visual.*`, `lm_head.*`;
older checkpoints `model.*`, `visual.*`, `lm_head.*`. Both load.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from rein.kernels import elementwise
from rein.model.architectures.llama import LlamaFamilyModel
from rein.model.architectures.rope import RotaryEmbedding, apply_rotary
from rein.model.architectures.weights import TensorGetter
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.spec import ModelSpec
from rein.model.vision.base import checkpoint_prefixes


class MRotaryEmbedding(RotaryEmbedding):
    """Rope whose frequency columns take the t, h or w position by section (`section`: how many
    of the head_dim / 2 frequencies each takes, in that order)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, section: tuple[int, ...]) -> None:
        super().__init__(head_dim, max_positions, theta, None)
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must add up to head_dim / 2 = {head_dim // 2}")
        self.section = tuple(section)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions)
        cos, sin, start = [], [], 0
        for axis, width in enumerate(self.section):
            rows = positions[axis % 3]
            cos.append(self.cos[rows, start:start + width])
            sin.append(self.sin[rows, start:start + width])
            start += width
        return torch.cat(cos, dim=-1).unsqueeze(1), torch.cat(sin, dim=-1).unsqueeze(1)


class _PatchMatmul:
    """A patch embedding's Conv3d (kernel = stride = one patch) as the matmul it is: each row of
    the input is one patch's C x T x P x P values, in the order the weight's flattening takes."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        from rein.model.architectures.linear import linear

        return linear(pixels.to(self.weight.dtype), self.weight)


def vision_attention(self: nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                     max_seqlen: int | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' Qwen2-VL / Qwen2.5-VL vision attention (VisionAttention.forward: the same
    products), with rein's in-place rotary kernel (C on the CPU, Triton on CUDA) where transformers
    builds rotate-half copies, and each image's (or window's) attention written into one output
    instead of split and concatenated: the rotary copies and concatenations were a third of the
    encoder's CPU time."""
    tokens = hidden_states.shape[0]
    heads, head_dim, dim = self.num_heads, self.head_dim, self.num_heads * self.head_dim
    qkv = self.qkv(hidden_states)
    cos, sin = position_embeddings   # [T, head_dim]: the same half twice (rotate-half layout)
    half = head_dim // 2
    cos = cos[:, :half].float().contiguous().unsqueeze(1)
    sin = sin[:, :half].float().contiguous().unsqueeze(1)
    qk = qkv[:, :2 * dim].view(tokens, 2 * heads, head_dim)
    if not elementwise.rotary_(qk, cos, sin):
        qk = apply_rotary(qk, cos, sin)
    q, k = qk[:, :heads].transpose(0, 1), qk[:, heads:].transpose(0, 1)
    v = qkv[:, 2 * dim:].view(tokens, heads, head_dim).transpose(0, 1)
    out = torch.empty(heads, tokens, head_dim, dtype=qkv.dtype, device=qkv.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=False):
        if end > start:
            # 4-D [1, heads, n, d], as transformers passes them: 3-D inputs take torch's math path.
            out[:, start:end] = nn.functional.scaled_dot_product_attention(
                q[None, :, start:end], k[None, :, start:end], v[None, :, start:end], scale=self.scaling)[0]
    return self.proj(out.transpose(0, 1).reshape(tokens, dim))


def hf_config(raw: dict[str, Any]) -> Any:
    """transformers' config object of the model (from config.json's dict)."""
    from transformers import AutoConfig

    raw = dict(raw)
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


class Qwen2VLModel(LlamaFamilyModel):
    """See the module docstring; implements rein.model.vision.base.VisionLanguageModel."""

    image_tokens_whole_chunk = False

    def __init__(self, spec: ModelSpec, max_positions: int, group: ParallelGroup = SINGLE_RANK) -> None:
        if group.world_size > 1:
            raise ValueError("vision models run on one rank: use tensor_parallel_size 1")
        super().__init__(spec, max_positions, group)
        if not spec.mrope_section:
            raise ValueError(f"{spec.architecture}: config.json names no mrope_section")
        self.rope = MRotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.mrope_section)
        self.hf_config = hf_config(spec.vision_config)
        self.image_token_id = int(self.hf_config.image_token_id)
        self.merge_size = int(self.hf_config.vision_config.spatial_merge_size)
        self.visual: nn.Module | None = None   # built in load_hf_weights, where the device is known

    # -- text ------------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def mrope_positions(self, token_ids: list[int], image_grids: list[Any]) -> tuple[torch.Tensor, int]:
        """The prompt's [3, n] positions and its delta, as transformers' get_rope_index: text
        runs count on from the last position on all three axes; an image of grid (t, h, w)
        patches takes t x (h / merge) x (w / merge) positions (start + its t, h, w index) and
        moves the next position on by max(h, w) / merge."""
        ids = torch.tensor(token_ids, dtype=torch.int64)
        is_image = (ids == self.image_token_id).tolist()
        parts, current, i, n, grids = [], 0, 0, len(token_ids), iter(image_grids)
        merge = self.merge_size
        while i < n:
            j = i
            while j < n and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                parts.append((torch.arange(j - i, dtype=torch.int64) + current).expand(3, -1))
                current += j - i
            else:
                t, h, w = next(grids)
                gt, gh, gw = t, h // merge, w // merge
                tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh) + current,
                                            torch.arange(gw) + current, indexing="ij")
                block = torch.stack([tt + current, hh, ww]).reshape(3, -1)
                if block.shape[1] != j - i:
                    raise ValueError(f"an image of grid {(t, h, w)} takes {block.shape[1]} tokens, the prompt holds "
                                     f"{j - i}")
                parts.append(block)
                current += max(h, w) // merge
            i = j
        positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.int64)
        return positions, int(positions.max()) + 1 - n if n else 0

    # -- vision ------------------------------------------------------------------------------

    def encode_images(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        visual = self.visual
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        pixels = torch.cat([p["pixel_values"] for p in pixel_inputs]).to(device=device, dtype=dtype)
        grid = torch.cat([p["image_grid_thw"] for p in pixel_inputs]).to(device)
        out = visual(pixels, grid_thw=grid)
        embeds = getattr(out, "pooler_output", out)
        sizes = (grid.prod(-1) // self.merge_size**2).tolist()
        return [e.to(dtype) for e in torch.split(embeds, sizes)]

    def pack_cpu_weights(self) -> None:
        """On the CPU (the loader calls this there only): the text model's weights packed as
        LlamaFamilyModel packs them, and the vision tower's linears made rein's `Linear` and
        packed for oneDNN too (bench/vision.py: the encoder a third faster on one thread). Its
        patch embedding, a Conv3d whose kernel is its stride over inputs already cut into patches,
        becomes the same product as one matmul (the convolution took a sixth of the encoder)."""
        super().pack_cpu_weights()
        from rein.model.architectures.linear import Linear, pack_weights

        for module in self.visual.modules():
            if type(module) is nn.Linear:
                module.__class__ = Linear
        pack_weights(self.visual)
        embed = self.visual.patch_embed
        if isinstance(getattr(embed, "proj", None), nn.Conv3d) and embed.proj.bias is None:
            embed.forward = _PatchMatmul(embed.proj.weight.detach().reshape(embed.proj.out_channels, -1).contiguous())

    def _build_visual(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """transformers' vision tower, on `device` in `dtype`, parameters not set yet."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel,
        )

        config = self.hf_config.vision_config
        config._attn_implementation = "sdpa"
        cls = Qwen2_5_VisionTransformerPretrainedModel if self.spec.family == "qwen2_5_vl" \
            else Qwen2VisionTransformerPretrainedModel
        with torch.device("meta"):
            visual = cls(config)
        visual.to_empty(device=device)
        visual.to(dtype)
        # Buffers (the rotary tables) are computed in the modules' __init__, never saved:
        # build those modules again for real, in float32 as transformers keeps them.
        for name, module in list(visual.named_modules()):
            if module._buffers:
                owner, _, leaf = name.rpartition(".")
                with torch.device(device):
                    fresh = type(module)(config)
                setattr(visual.get_submodule(owner) if owner else visual, leaf, fresh)
        for module in visual.modules():
            if type(module).__name__ in ("VisionAttention", "Qwen2_5_VLVisionAttention"):
                module.forward = types.MethodType(vision_attention, module)
        return visual.eval()

    def load_hf_weights(self, get: TensorGetter) -> None:
        found = checkpoint_prefixes(get, {"text": ("model.language_model.", "model.", "embed_tokens.weight"),
                                          "vision": ("model.visual.", "visual.", "patch_embed.proj.weight")})
        text, vision = found["text"], found["vision"]

        def text_get(name: str, *args: Any, **kwargs: Any) -> Any:
            if name.startswith("model."):
                name = text + name.removeprefix("model.")
            return get(name, *args, **kwargs)

        super().load_hf_weights(text_get)
        weight = self.embed_tokens.weight
        visual = self._build_visual(weight.device, weight.dtype)
        missing = []
        with torch.no_grad():
            for name, param in visual.named_parameters():
                tensor = get(vision + name)
                if tensor is None:
                    missing.append(vision + name)
                    continue
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"weight {vision + name}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"{tuple(param.shape)}")
                param.copy_(tensor)
        if missing:
            raise ValueError(f"vision weights not found in the checkpoint: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        self.visual = visual
