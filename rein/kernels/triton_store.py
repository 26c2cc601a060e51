"""Triton kernel that writes new key/value rows into the paged KV cache, plus the checks
every Triton launcher in this package shares.

Layout (see rein/kernels/reference.py, the specification):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float32 (int8 caches only)
Token t goes to slot s = slot_mapping[t], i.e. block s // block_size, offset s % block_size;
s == -1 marks a padding token that is skipped.

For an int8 cache the kernel quantizes on the fly exactly like `reference.quantize_int8`:
scale = max(absmax / 127, 1e-8) per (token, kv head), q = round_half_even(x / scale)
clamped to +-127. Both divisions use IEEE round-to-nearest (`div_rn`) because Triton's
default fp32 division on NVIDIA is approximate, and the reference's result is bit-exact
torch division; with the approximate one a value sitting on a .5 boundary could round the
other way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CACHE_DTYPES = (*FLOAT_DTYPES, torch.int8)


# --------------------------------------------------------------------------------------
# Shared launcher checks (used by triton_decode and triton_prefill too).
# --------------------------------------------------------------------------------------


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    device: torch.device,
    need_scales: bool,
) -> None:
    """Validate the cache pair (and scales) against the layout the kernels assume.

    The kernels index caches with explicit strides but assume the last dimension is
    contiguous and that K and V share one shape; scales are indexed with their own strides.
    `need_scales` is True when the caller will read the scales (int8 cache, or the
    attention kernels when scales are passed, mirroring the reference).
    """
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], got shape "
            f"{tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"cache dtypes must match and be one of {CACHE_DTYPES}, got {k_cache.dtype}/{v_cache.dtype}"
        )
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass both k_scale and v_scale, or neither")
    if k_cache.dtype == torch.int8 and k_scale is None:
        raise ValueError("an int8 KV cache needs k_scale and v_scale tensors")
    if need_scales and k_scale is not None:
        expected = tuple(k_cache.shape[:3])
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
            if t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32, got {t.dtype}")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device}, expected {device}")
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")


def check_rows(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """An activation tensor: given shape, float dtype, unit stride on the last dim."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of {FLOAT_DTYPES}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride()})")


def check_index(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    """An integer index tensor (slot mapping, block table, lengths)."""
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def head_dim_pad(head_dim: int) -> int:
    """Power-of-two tile width for head_dim; at least 16 so it can be a tl.dot dimension."""
    return max(16, triton.next_power_of_2(head_dim))


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------


@triton.jit
def _round_half_even(x):
    # libdevice.rint would do, but extern calls do not run in the interpreter the tests use.
    # |x| <= 127 here, so x - floor(x) is exact in fp32.
    f = tl.floor(x)
    frac = x - f
    f_is_odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & f_is_odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quantize_store(x, mask, cache_ptrs, scale_ptrs, h_mask):
    """Quantize x [BLOCK_H, D] per row (one kv head) to int8 and write values and scales."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    absmax = tl.max(tl.abs(xf), axis=1)
    scale = tl.maximum(tl.math.div_rn(absmax, 127.0), 1e-8)
    q = _round_half_even(tl.math.div_rn(xf, scale[:, None]))
    q = tl.minimum(tl.maximum(q, -127.0), 127.0)
    tl.store(cache_ptrs, q.to(tl.int8), mask=mask)
    tl.store(scale_ptrs, scale, mask=h_mask)


@triton.jit
def _store_kv_kernel(
    KEY, VALUE, K_CACHE, V_CACHE, K_SCALE, V_SCALE, SLOTS,
    num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    IS_INT8: tl.constexpr,
):
    # One program per (token, group of BLOCK_H kv heads); K and V in the same program so the
    # slot is read once.
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    slot = tl.load(SLOTS + tok).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = h < num_kv_heads
    mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]

    tok64 = tok.to(tl.int64)  # T * stride can exceed int32 for long prefills
    k = tl.load(KEY + tok64 * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(VALUE + tok64 * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    # Caches can exceed 2**31 elements: block offsets in int64.
    c_off = blk * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :]
    if IS_INT8:
        s_off = blk * stride_sb + off * stride_st + h * stride_sh
        _quantize_store(k, mask, K_CACHE + c_off, K_SCALE + s_off, h_mask)
        _quantize_store(v, mask, V_CACHE + c_off, V_SCALE + s_off, h_mask)
    else:
        tl.store(K_CACHE + c_off, k.to(K_CACHE.dtype.element_ty), mask=mask)
        tl.store(V_CACHE + c_off, v.to(V_CACHE.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged cache at slot_mapping [T].

    Same contract as `reference.store_kv`. key/value may be strided views (e.g. slices of a
    fused QKV projection) as long as head_dim is contiguous. No host synchronisation.
    """
    device = key.device
    is_int8 = k_cache.dtype == torch.int8
    check_cache(k_cache, v_cache, k_scale, v_scale, device, need_scales=is_int8)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = key.shape[0] if key.dim() == 3 else -1
    check_rows("key", key, (num_tokens, num_kv_heads, head_dim), device)
    check_rows("value", value, (num_tokens, num_kv_heads, head_dim), device)
    check_index("slot_mapping", slot_mapping, 1, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()

    d_pad = triton.next_power_of_2(head_dim)
    # Bound the tile to ~4K elements so wide models (many kv heads) split over grid axis 1.
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // d_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    ks = k_scale if is_int8 else k_cache  # dummy pointers when unused (constexpr-dead)
    vs = v_scale if is_int8 else v_cache
    s_strides = k_scale.stride() if is_int8 else (0, 0, 0)
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, ks, vs, slot_mapping,
        num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *s_strides,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=d_pad,
        BLOCK_H=block_h,
        IS_INT8=is_int8,
        num_warps=4 if block_h * d_pad >= 1024 else 2,
    )
