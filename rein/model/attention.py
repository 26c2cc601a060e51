"""Attention over the paged KV cache for one engine step, for any model layer.

A step's tokens are laid out decode requests first (one token each), then the chunks of
requests being prefilled. Each group goes to its own kernel: decode attention batches
all single-token queries; prefill attention handles variable-length chunks with a prefix.

On CUDA, a step whose prompts all start at their first token (no cached prefix, no earlier
chunk) can instead attend over its own K/V with torch's flash varlen attention, which the GPU
check measured at about twice the Triton prefill kernel's TFLOP/s (docs/benchmarks.md): chosen
by REIN_CUDA_PREFILL_ATTENTION=flash and the step's `prefill_without_prefix`; everything else
takes the paged kernel.

Sliding-window layers may keep their K/V in storage of their own (rein.engine.window_blocks),
indexed by other block ids than the full-attention layers' caches: their LayerCache says
so (`windowed`), and the step's metadata then carries their slots and block tables in
`windowed`, which `paged_attention` uses for them. Model code is the same either way.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

import torch

from rein import kernels
from rein.core.settings import setting_or_default


def varlen_attn(*args, **kwargs) -> torch.Tensor:
    """torch's flash varlen attention, imported on first use: its module imports torch._dynamo
    (with sympy and triton, about 130 MiB resident), which a CPU engine never needs."""
    from torch.nn.attention.varlen import varlen_attn as attend
    return attend(*args, **kwargs)


@functools.cache
def has_varlen_attn() -> bool:
    """Recent torch only; without it every prefill takes the Triton kernel."""
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


@dataclass
class LayerCache:
    """One layer's slice of the paged cache (scales only for int8); `windowed`: a sliding-window
    layer's own storage, indexed through AttentionMetadata.windowed."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    windowed: bool = False


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
    # Host-side: every prefill chunk starts at its prompt's first token (nothing cached before
    # it), so its attention needs only this step's own K/V.
    prefill_without_prefix: bool = False
    # The same step for the windowed layers' own storage: its slots and block tables (blocks
    # before every query's window map to 0, which the kernels never read); None without one.
    windowed: AttentionMetadata | None = None
    # The longest decode context, read from decode_context_lens once (a reduction and a host
    # read) for all of a step's layers; the metadata's tensors are not changed once it is built.
    _decode_max_context: int | None = field(default=None, init=False, repr=False, compare=False)

    def decode_max_context(self) -> int:
        """max(decode_context_lens), for the CPU decode kernel's scratch."""
        if self._decode_max_context is None:
            self._decode_max_context = int(self.decode_context_lens.max())
        return self._decode_max_context

    def for_cache(self, cache: LayerCache, window: int | None) -> AttentionMetadata:
        """The metadata that indexes `cache`."""
        if not cache.windowed:
            return self
        if window is None:
            raise ValueError("a layer without a sliding window was given windowed KV storage, which holds "
                             "only the blocks a window covers")
        return self.windowed


def rotary_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache: LayerCache,
    meta: AttentionMetadata,
    window: int | None = None,
) -> bool:
    """Rotate q and k in place and store the rotated k and v in the cache, in one kernel where one
    applies (CUDA; float32 on the CPU); then call paged_attention with kv_stored=True. False, nothing done,
    elsewhere: the caller rotates q and k itself and paged_attention stores them."""
    meta = meta.for_cache(cache, window)
    return kernels.rotary_store_kv(q, k, v, *rotary, cache.k, cache.v, meta.slot_mapping,
                                   cache.k_scale, cache.v_scale)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LayerCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    kv_stored: bool = False,
) -> torch.Tensor:
    """Store this step's k/v [T, kvh, d] in the cache, then attend; q [T, heads, d] -> same shape.
    window: the layer's sliding window in tokens (None: full causal attention). kv_stored: k and
    v are in the cache already (rotary_store_kv wrote them)."""
    meta = meta.for_cache(cache, window)
    if not kv_stored:
        kernels.store_kv(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale, cache.v_scale)
    num_decode = meta.num_decode_tokens
    if num_decode == 0:
        return _prefill(q, k, v, cache, meta, scale, window)
    if num_decode == q.shape[0] and not meta.decode_groups:
        return kernels.paged_decode_attention(
            q, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, scale,
            cache.k_scale, cache.v_scale, window, meta.decode_max_context() if q.is_cpu else None,
        )
    out = torch.empty_like(q)
    for start, end in meta.decode_groups or [(0, num_decode)]:
        out[start:end] = kernels.paged_decode_attention(
            q[start:end], cache.k, cache.v, meta.decode_block_tables[start:end],
            meta.decode_context_lens[start:end], scale, cache.k_scale, cache.v_scale, window,
        )
    if num_decode < q.shape[0]:
        out[num_decode:] = _prefill(q[num_decode:], k[num_decode:], v[num_decode:], cache, meta, scale, window)
    return out


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
             scale: float, window: int | None) -> torch.Tensor:
    if flash_prefill(q, meta):
        # Sequences are packed back to back and each query sees its own prompt only: the
        # query offsets are the key offsets, the step's row count bounds every length.
        rows = q.shape[0]
        cu_seqlens = meta.prefill_cu_seqlens_q
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, rows, rows, scale=scale,
                           window_size=(-1, 0) if window is None else (window - 1, 0), enable_gqa=True)
    return kernels.paged_prefill_attention(
        q, cache.k, cache.v, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
        meta.prefill_context_lens, scale, cache.k_scale, cache.v_scale, window,
    )


def flash_prefill(q: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this step's prefill runs torch's flash varlen attention over its own K/V: on CUDA
    in fp16/bf16, selected (REIN_CUDA_PREFILL_ATTENTION=flash), no prompt with a cached prefix."""
    return (meta.prefill_without_prefix and q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
            and has_varlen_attn() and cuda_prefill_flash())


@functools.cache
def cuda_prefill_flash() -> bool:
    """REIN_CUDA_PREFILL_ATTENTION=flash (rein.core.settings), read once per process
    (`cuda_prefill_flash.cache_clear()` re-reads)."""
    return setting_or_default("cuda_prefill_attention") == "flash"
