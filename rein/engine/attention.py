"""Attention over the paged KV cache for one engine step, for any model layer.

A step's tokens are laid out decode requests first (one token each), then the chunks of
requests being prefilled. Each group goes to its own kernel: decode attention batches
all single-token queries; prefill attention handles variable-length chunks with a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rein import kernels


@dataclass
class LayerCache:
    """One layer's slice of the paged cache (scales only for int8)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each query may see."""

    slot_mapping: torch.Tensor          # [T] cache slot of every token
    num_decode_tokens: int              # rows [0, num_decode_tokens) are single-token decodes
    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_groups: list[tuple[int, int]] | None   # decode row ranges run as separate calls
    prefill_block_tables: torch.Tensor | None
    prefill_cu_seqlens_q: torch.Tensor | None   # offsets relative to the first prefill row
    prefill_context_lens: torch.Tensor | None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Store this step's k/v [T, kvh, d] in the cache, then attend; q [T, heads, d] -> same shape.
    window: the layer's sliding window in tokens (None: full causal attention)."""
    kernels.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    num_decode = meta.num_decode_tokens
    if num_decode == 0:
        return _prefill(q, cache, meta, scale, window)
    if num_decode == q.shape[0] and not meta.decode_groups:
        return kernels.paged_decode_attention(
            q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale,
            cache.k_scale, cache.v_scale, window,
        )
    out = torch.empty_like(q)
    for start, end in meta.decode_groups or [(0, num_decode)]:
        out[start:end] = kernels.paged_decode_attention(
            q[start:end], cache.k, cache.v, meta.decode_block_tables[start:end],
            meta.decode_context_lens[start:end], scale, cache.k_scale, cache.v_scale, window,
        )
    if num_decode < q.shape[0]:
        out[num_decode:] = _prefill(q[num_decode:], cache, meta, scale, window)
    return out


def _prefill(q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
             window: int | None) -> torch.Tensor:
    return kernels.paged_prefill_attention(
        q, cache.k, cache.v, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
        meta.prefill_context_lens, scale, cache.k_scale, cache.v_scale, window,
    )
