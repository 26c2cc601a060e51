"""Attention over the paged KV cache: Triton kernels on CUDA, native C decode and prefill
attention on the CPU where they build (rein.kernels.cpu_native), the torch reference otherwise.

The engine calls only the functions defined here; `use_triton` decides once per
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


def rotary_store_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> bool:
    """Rotate query and key in place and write the rotated key and the value into the cache in one
    kernel (rein.kernels.triton_rotary_store on CUDA; rein.kernels.cpu_native's C kernel for float32
    on the CPU, any cache but int8). False, nothing touched, elsewhere: the caller rotates q and k
    and calls store_kv."""
    if query.device.type == "cpu":
        if k_scale is not None:
            return False
        from rein.kernels import cpu_native

        return cpu_native.rotary_store_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping)
    if not use_triton(query):
        return False
    from rein.kernels import triton_rotary_store

    return triton_rotary_store.rotary_store_kv(query, key, value, cos, sin, k_cache, v_cache, slot_mapping,
                                               k_scale, v_scale)


def check_window(window: int | None) -> None:
    """A sliding window is a positive token count (None: full causal attention)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive number of tokens or None, got {window!r}")


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                           k_scale=None, v_scale=None, window: int | None = None,
                           max_context: int | None = None) -> torch.Tensor:
    """See rein.kernels.reference.paged_decode_attention (window: sliding-window attention;
    max_context: the longest context length where the caller knows it, for the C kernel)."""
    check_window(window)
    if query.is_cpu:
        if k_scale is None:
            from rein.kernels import cpu_native

            out = cpu_native.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                                    window=window, max_context=max_context)
            if out is not None:
                return out
    elif use_triton(query):
        from rein.kernels import triton_ops

        return triton_ops.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                 context_lens, scale, k_scale, v_scale, window)
    return reference.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                            context_lens, scale, k_scale, v_scale, window)


def paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale, k_scale=None, v_scale=None, window: int | None = None) -> torch.Tensor:
    """See rein.kernels.reference.paged_prefill_attention (window: sliding-window attention)."""
    check_window(window)
    if use_triton(query):
        from rein.kernels import triton_ops

        return triton_ops.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                                  cu_seqlens_q, context_lens, scale,
                                                  k_scale, v_scale, window)
    if k_scale is None and query.device.type == "cpu":
        from rein.kernels import cpu_native

        if cpu_native.prefill_attention_pays():
            out = cpu_native.paged_prefill_attention(query, k_cache, v_cache, block_tables, cu_seqlens_q,
                                                     context_lens, scale, window=window)
            if out is not None:
                return out
    return reference.paged_prefill_attention(query, k_cache, v_cache, block_tables,
                                             cu_seqlens_q, context_lens, scale, k_scale, v_scale, window)
