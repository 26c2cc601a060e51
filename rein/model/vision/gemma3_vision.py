"""Gemma 3 with vision (4B and up): rein's native Gemma 3 text model (sliding windows, two rope
bases) and the SigLIP tower with Gemma 3's pooled projector (rein.model.vision.encoders).

What differs from text-only Gemma 3:

* An image is `<start_of_image>` + mm_tokens_per_image x `<image_soft_token>` + `<end_of_image>`;
  the soft tokens' rows are the projector's output, not scaled by sqrt(hidden) as text
  embeddings are (transformers scales the text embeddings, then overwrites the image rows).
* An image's soft tokens attend to each other both ways (transformers 5 builds its prefill mask
  as causal OR same-image block, from `token_type_ids`; on sliding layers that AND the window).
  transformers applies it to the prompt's forward only; later tokens attend causally, as rein's
  decode does anyway. So rein computes an image's tokens in one prefill chunk
  (`image_tokens_whole_chunk`: the scheduler never cuts an image, and a prefix-cache hit is
  trimmed back to an image's start) and, in a prefill chunk holding image tokens, recomputes
  those requests' attention rows with that mask (`image_block_attention`: torch, the same on
  CPU and CUDA; the paged kernels stay causal, and a chunk without image tokens never takes
  this path). An image block is a run of `<image_soft_token>` within the chunk, as
  transformers' `get_block_sequence_ids_for_mask` finds them; a block's keys before the chunk
  (none, given whole-image chunks) would be seen causally anyway.

Checkpoint layouts: transformers 5's `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*` (and a tied head), and the older `language_model.model.*`,
`vision_tower.*`, `multi_modal_projector.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rein.kernels.reference import gather_kv
from rein.model.architectures.gemma3 import Gemma3DecoderLayer, Gemma3Model
from rein.model.architectures.llama import Attention
from rein.model.architectures.rope import apply_rotary
from rein.model.architectures.weights import TensorGetter
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.spec import ModelSpec
from rein.model.vision.encoders import make_encoder
from rein.model.vision.hf_parts import hf_config, text_getter


@dataclass
class ImageBlocks:
    """The prefill requests of a step whose chunk holds image tokens: per request its index among
    the step's prefills, its rows [q0, q1) relative to the first prefill row, its context length
    (cached + chunk) and, per row, the image block the row belongs to (-1: text)."""

    requests: list[tuple[int, int, int, int, torch.Tensor]]


def find_image_blocks(input_ids: torch.Tensor, meta: AttentionMetadata, image_token_id: int) -> ImageBlocks | None:
    """The step's image blocks (None when no prefill row is an image token: the usual case,
    decided with one host sync on prefill steps only)."""
    if meta.prefill_cu_seqlens_q is None:
        return None
    rows = input_ids[meta.num_decode_tokens:]
    is_image = rows == image_token_id
    if not bool(is_image.any()):
        return None
    starts = meta.prefill_cu_seqlens_q.tolist()
    lengths = meta.prefill_context_lens.tolist()
    found = []
    for i, ctx in enumerate(lengths):
        q0, q1 = starts[i], starts[i + 1]
        mine = is_image[q0:q1]
        if q1 == q0 or not bool(mine.any()):
            continue
        previous = nn.functional.pad(mine, (1, 0), value=False)[:-1]
        opens = mine & ~previous
        blocks = torch.where(mine, torch.cumsum(opens.int(), 0) - 1, -1)
        found.append((i, q0, q1, int(ctx), blocks))
    return ImageBlocks(found) if found else None


def image_block_attention(out: torch.Tensor, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                          scale: float, window: int | None, blocks: ImageBlocks) -> torch.Tensor:
    """`out` (the paged kernels' causal attention of the step) with the image rows of the requests
    in `blocks` recomputed under Gemma 3's image mask: a query sees a key when it is causal or in
    the query's own image block, and (sliding layers) within the window."""
    meta = meta.for_cache(cache, window)
    decode = meta.num_decode_tokens
    block_size = cache.k.shape[1]
    for i, q0, q1, ctx, row_blocks in blocks.requests:
        q_len = q1 - q0
        device = q.device
        row_blocks = row_blocks.to(device)
        # Only image rows see more than causal attention gives them: text rows keep the kernels' output.
        rows = torch.nonzero(row_blocks >= 0).squeeze(1)
        first_row = int(rows[0])
        # Keys from the first image row's window (sliding layers) to the end of the last image block.
        first = ctx - q_len + first_row
        first_block = 0 if window is None else max(0, first - window + 1) // block_size
        offset = first_block * block_size
        end = ctx - q_len + int(rows[-1]) + 1
        table = meta.prefill_block_tables[i, first_block:]
        keys = gather_kv(cache.k, cache.k_scale, table, end - offset, q.dtype)   # [L, kvh, d]
        values = gather_kv(cache.v, cache.v_scale, table, end - offset, q.dtype)
        q_pos = (ctx - q_len + rows).unsqueeze(1)
        k_pos = torch.arange(offset, end, device=device).unsqueeze(0)
        key_blocks = torch.full((end - offset,), -1, dtype=row_blocks.dtype, device=device)
        chunk_start = ctx - q_len - offset   # key index of the chunk's first row (may be < 0: window)
        key_blocks[max(0, chunk_start):] = row_blocks[max(0, -chunk_start):end - offset - chunk_start]
        query_blocks = row_blocks[rows].unsqueeze(1)
        mask = (k_pos <= q_pos) | (query_blocks == key_blocks.unsqueeze(0))
        if window is not None:
            mask &= k_pos > q_pos - window
        targets = decode + q0 + rows
        o = nn.functional.scaled_dot_product_attention(
            q[targets].transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True)
        out[targets] = o[0].transpose(0, 1).to(out.dtype)
    return out


class ImageBlockAttention(Attention):
    """Gemma 3's attention (q/k norms, rope, the paged cache) with image blocks' rows recomputed."""

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata, blocks: ImageBlocks | None = None) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].view(tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        out = paged_attention(q, k, v, cache, meta, self.scale, window=self.window)
        if blocks is not None:
            out = image_block_attention(out, q, cache, meta, self.scale, self.window, blocks)
        return self.group.all_reduce_(self.o_proj(out.reshape(tokens, self.q_size)))


class Gemma3VisionDecoderLayer(Gemma3DecoderLayer):
    def __init__(self, spec: ModelSpec, window: int | None, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__(spec, window, group)
        self.self_attn = ImageBlockAttention(spec, window, group)   # the layer passes it the image blocks


class Gemma3VisionModel(Gemma3Model):
    """See the module docstring; implements rein.model.vision.base.VisionLanguageModel."""

    image_tokens_whole_chunk = True
    text_prefixes = ("model.language_model.", "language_model.model.")
    head_names = ("lm_head.weight", "language_model.lm_head.weight")

    def __init__(self, spec: ModelSpec, max_positions: int, group: ParallelGroup = SINGLE_RANK) -> None:
        if group.world_size > 1:
            raise ValueError("vision models run on one rank: use tensor_parallel_size 1")
        super().__init__(spec, max_positions, group)
        self.hf_config = hf_config(spec.vision_config)
        self.image_token_id = int(self.hf_config.image_token_id)
        self.encoder: nn.Module | None = None   # built in load_hf_weights

    def make_layers(self, spec: ModelSpec, group: ParallelGroup) -> list[nn.Module]:
        return [Gemma3VisionDecoderLayer(spec, window, group) for window in spec.layer_windows]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The image token may lie outside the text vocabulary (transformers looks up 0 for it);
        # its rows are overwritten by the image's anyway.
        ids = input_ids.masked_fill(input_ids >= self.spec.vocab_size, 0)
        x = self.embed_tokens(ids)
        return x * torch.tensor(self.spec.hidden_size**0.5, dtype=x.dtype)

    def mrope_positions(self, token_ids: list[int], image_grids: list[Any]) -> None:
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[LayerCache],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        blocks = find_image_blocks(input_ids, meta, self.image_token_id) if inputs_embeds is not None else None
        full, local = self.rope(positions), self.local_rope(positions)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, local if layer.window is not None else full, cache, meta, blocks)
        return self.norm(x)

    def encode_images(self, pixel_inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        dtype = self.embed_tokens.weight.dtype
        return [rows.to(dtype) for rows in self.encoder(pixel_inputs)]

    def load_hf_weights(self, get: TensorGetter) -> None:
        super().load_hf_weights(text_getter(get, self.text_prefixes, self.head_names))
        weight = self.embed_tokens.weight
        self.encoder = make_encoder(self.hf_config, weight.dtype, weight.device, get)
