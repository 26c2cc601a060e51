"""Attention over the paged KV cache: Triton kernels on CUDA, native C decode and prefill
attention on the CPU where they build (rein.kernels.cpu_native), the torch reference otherwise.

The engine calls only the three functions exported here; `use_triton` decides once per
call which implementation runs, by the device of the tensors.
"""

from __future__ import annotations

import torch

from rein.kernels import reference


def use_triton(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors only; CPU tensors take the reference path."""
    if t.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if use_triton(key):
        from rein.kernels import triton_ops

        return triton_ops.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None) -> torch.Tensor:
    if use_triton(query):
        from rein.kernels import triton_ops

        return triton_ops.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                 context_lens, scale, k_scale, v_scale)
    if k_scale is None and query.device.type == "cpu":
        from rein.kernels import cpu_native

        out = cpu_native.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)
        if out is not None:
            return out
    return reference.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                            context_lens, scale, k_scale, v_scale)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale, k_scale=None, v_scale=None) -> torch.Tensor:
    if use_triton(query):
        from rein.kernels import triton_ops

        return triton_ops.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                                  cu_seqlens_q, context_lens, scale,
                                                  k_scale, v_scale)
    if k_scale is None and query.device.type == "cpu":
        from rein.kernels import cpu_native

        out = cpu_native.paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                 context_lens, scale)
        if out is not None:
            return out
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                             cu_seqlens_q, context_lens, scale, k_scale, v_scale)
