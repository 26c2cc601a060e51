"""Rotary embedding fused with the K/V cache write: one Triton kernel where a layer's attention
otherwise launched two (rotary in place on Q and K, then `store_kv`).

One program per (token, head) over the query heads and then the KV heads:
  * a query head is rotated in place (attention reads q next);
  * a KV head's key is rotated in place and written, with its value, into the paged cache at
    the token's slot (quantized to int8 with per token/head scales for an int8 cache, exactly
    as `triton_store`); a slot of -1 (padding) writes nothing to the cache. The key is rotated
    in place too because a prefill without a cached prefix may attend over the step's own k
    and v (rein.model.attention) rather than the cache.
The arithmetic is rein.model.architectures.rope.apply_rotary's (rotate-half layout, float32
rotation, the result rounded to the activation dtype) followed by triton_store's write of that
rounded key, so the cache holds the bytes the two separate kernels wrote.

At a decode step the two launches per layer each move a few kilobytes; the saving is a launch
and the re-read of K (ISSUE 47: the six small kernels of a layer cost 1.1-1.7 us each on an
H200). No host synchronization: capturable in CUDA graphs. Tested under the Triton interpreter
(tests/kernels/test_triton_rotary_store.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.kernels.triton_store import _round_half_even, check_cache, check_index, check_rows


@triton.jit
def _quantize_halves(x1, x2, offs, mask, cache_ptr, half, scale_ptr):
    """Write one head's two halves as int8 with one scale (reference.quantize_int8's rounding)."""
    a = tl.where(mask, x1.to(tl.float32), 0.0)
    b = tl.where(mask, x2.to(tl.float32), 0.0)
    absmax = tl.maximum(tl.max(tl.abs(a), axis=0), tl.max(tl.abs(b), axis=0))
    scale = tl.maximum(tl.math.div_rn(absmax, 127.0), 1e-8)
    qa = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(a, scale)), -127.0), 127.0)
    qb = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(b, scale)), -127.0), 127.0)
    tl.store(cache_ptr + offs, qa.to(tl.int8), mask=mask)
    tl.store(cache_ptr + half + offs, qb.to(tl.int8), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _rotary_store_kernel(
    Q, K, V, COS, SIN, K_CACHE, V_CACHE, K_SCALE, V_SCALE, SLOTS,
    num_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_sb, stride_st, stride_sh,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_INT8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, HALF_PAD)
    mask = offs < HALF
    c = tl.load(COS + tok * HALF + offs, mask=mask, other=0.0)
    s = tl.load(SIN + tok * HALF + offs, mask=mask, other=0.0)
    if head < num_heads:
        base = Q + tok * stride_qt + head * stride_qh
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base + offs, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(base + HALF + offs, (b * c + a * s).to(x1.dtype), mask=mask)
    else:
        kvh = head - num_heads
        slot = tl.load(SLOTS + tok).to(tl.int64)
        k_base = K + tok * stride_kt + kvh * stride_kh
        k1 = tl.load(k_base + offs, mask=mask, other=0.0)
        k2 = tl.load(k_base + HALF + offs, mask=mask, other=0.0)
        a, b = k1.to(tl.float32), k2.to(tl.float32)
        # Rounded to the activation dtype first, as the unfused path stores the rotated tensor.
        r1 = (a * c - b * s).to(k1.dtype)
        r2 = (b * c + a * s).to(k1.dtype)
        tl.store(k_base + offs, r1, mask=mask)
        tl.store(k_base + HALF + offs, r2, mask=mask)
        if slot >= 0:
            v_base = V + tok * stride_vt + kvh * stride_vh
            v1 = tl.load(v_base + offs, mask=mask, other=0.0)
            v2 = tl.load(v_base + HALF + offs, mask=mask, other=0.0)
            c_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch
            if IS_INT8:
                s_off = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + kvh * stride_sh
                _quantize_halves(r1, r2, offs, mask, K_CACHE + c_off, HALF, K_SCALE + s_off)
                _quantize_halves(v1, v2, offs, mask, V_CACHE + c_off, HALF, V_SCALE + s_off)
            else:
                tl.store(K_CACHE + c_off + offs, r1.to(K_CACHE.dtype.element_ty), mask=mask)
                tl.store(K_CACHE + c_off + HALF + offs, r2.to(K_CACHE.dtype.element_ty), mask=mask)
                tl.store(V_CACHE + c_off + offs, v1.to(V_CACHE.dtype.element_ty), mask=mask)
                tl.store(V_CACHE + c_off + HALF + offs, v2.to(V_CACHE.dtype.element_ty), mask=mask)


def rotary_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """Rotate query [T, heads, d] and key [T, kv_heads, d] in place and write the rotated key and
    the value into the paged cache at slot_mapping [T] (the contract of `store_kv`).
    cos/sin: float32 [T, 1, d / 2] or [T, d / 2], contiguous (RotaryEmbedding's lookup).
    Returns False, touching nothing, where the layout does not fit (the caller then rotates and
    calls store_kv); raises ValueError on a malformed cache or index, as store_kv does."""
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0]:
        return False
    tokens, num_heads, head_dim = query.shape
    half = head_dim // 2
    if (head_dim % 2 or query.stride(2) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.numel() != tokens * half or sin.numel() != tokens * half):
        return False
    device = query.device
    is_int8 = k_cache.dtype == torch.int8
    check_cache(k_cache, v_cache, k_scale, v_scale, device, need_scales=is_int8)
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        return False
    check_rows("key", key, (tokens, num_kv_heads, head_dim), device)
    check_rows("value", value, (tokens, num_kv_heads, head_dim), device)
    check_index("slot_mapping", slot_mapping, 1, device)
    if slot_mapping.shape[0] != tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {tokens} tokens")
    if tokens == 0:
        return True
    ks, vs = (k_scale, v_scale) if is_int8 else (k_cache, v_cache)   # dummy pointers when unused
    s_strides = k_scale.stride() if is_int8 else (0, 0, 0)
    _rotary_store_kernel[(tokens, num_heads + num_kv_heads)](
        query, key, value, cos, sin, k_cache, v_cache, ks, vs, slot_mapping.contiguous(),
        num_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *s_strides,
        HALF=half, HALF_PAD=triton.next_power_of_2(half), BLOCK_SIZE=block_size, IS_INT8=is_int8,
        num_warps=1 if half <= 64 else 2,
    )
    return True
