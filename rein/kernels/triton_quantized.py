"""Weight-only quantized matmul on CUDA: x @ dequant(w).T in one Triton kernel, the weight
dequantized tile by tile in registers and never written out dense.

`quantized_linear` is the CUDA path of rein.kernels.quantized's `QuantizedWeight` (group-wise
affine integers, w[n, k] = scale[n, k // group] * q[n, k] + offset[n, k // group]). Each program
computes one [BLOCK_M, BLOCK_N] tile of out = x @ w.T, walking K in BLOCK_K steps: it loads the
tile's integers and scales, dequantizes them in float32 to x's dtype (the rounding the torch
reference, `reference_linear`, does) and multiplies with `tl.dot`, accumulating in float32
(IEEE products for float32 x: tf32 would lose about three decimal digits).

How the layout is read:

* bits 8: q is int8 [N, K]; a K-tile is the int8 block q[n, k0:k0 + BLOCK_K].
* bits 4: q is uint8 [N, K / 2]; within each run of 32 columns, byte j holds column j in its low
  nibble and column j + 16 in its high one. BLOCK_K is a multiple of 32, so a K-tile is whole
  runs: bytes k0 / 2 + b for b < BLOCK_K / 2, where byte b (run b // 16, place b % 16) holds
  column k0 + (b // 16) * 32 + b % 16 low and that column + 16 high. Rather than interleave the
  nibbles back into column order, the kernel loads x's columns in the bytes' order -- the low
  columns and the high columns, each as a [BLOCK_M, BLOCK_K / 2] block of 16-column runs -- and
  takes two dots: x_low @ (byte & 15) + x_high @ (byte >> 4). The low and high column of a byte
  always share a group (groups are whole runs of 32), so one scale serves both nibbles.
* bits 5 and 6 (GGUF's Q5 / Q6 types, rein.kernels.packed_bits): each run of 32 columns is 16
  nibble bytes laid out as the 4-bit runs, then one 4-byte plane per high bit. The kernel
  (`_packed_matmul_kernel`) reads the nibbles as the 4-bit path does (two dots, low and high
  columns), gathers each column's plane byte (the bytes repeat across a run's columns and are
  served from L1) and ORs its bit in. The group's scale is the float16 per-block scale times the
  int8 per-group factor, gathered per column for the low and the high columns apart (Q6_K's
  groups of 16 put a byte's two columns in different groups); `zero` is subtracted first.
* scales: BLOCK_K divides the group where it can (one scale per row per tile, a [BLOCK_N]
  vector); for groups 16 and 32 a 64-column tile spans several groups and the scale is gathered
  per column ([BLOCK_K, BLOCK_N], served from L1).

Tiles: BLOCK_M follows M (16 rows for decode, up to 128 for prefill); BLOCK_N 64, or 128 with
128-row tiles. When M is small, the M x N tiles alone would leave most of the GPU's SMs idle (a
decode step of a 4096-row weight is 64 tiles on a 132-SM H200), so K is split across programs
that write float32 partial sums, added afterwards by torch (deterministic, no atomics).

Launched without a host synchronization (CUDA-graph capturable). Tested under the Triton
interpreter on CPU against `reference_linear` (tests/kernels/test_triton_quantized.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rein.kernels.quantized import NIBBLE_RUN, QuantizedWeight

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _quantized_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, c_ptr,
    M, N, K, tiles_per_split,
    stride_xm, stride_qn, stride_sn, stride_on, stride_cs, stride_cm,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past M / N wrap onto real ones, so loads need no row mask; the store is masked.
    x_rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm          # [BLOCK_M, 1]
    n_rows = (offs_n % N).to(tl.int64)
    q_rows = q_ptr + n_rows[None, :] * stride_qn                               # [1, BLOCK_N]
    s_rows = scale_ptr + n_rows * stride_sn                                    # [BLOCK_N]
    o_rows = offset_ptr + n_rows * stride_on
    dtype = x_ptr.dtype.element_ty
    # Columns of the tile in the order the integers are read: every column for 8 bits, the low
    # nibbles' columns for 4 bits (the high nibbles' are these + 16).
    offs_b = tl.arange(0, BLOCK_K // (8 // BITS))   # bytes of the tile's integers, per row
    if BITS == 4:
        offs_c = (offs_b // 16) * 32 + offs_b % 16
    else:
        offs_c = offs_b

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(first, last):
        k0 = t * BLOCK_K
        cols = k0 + offs_c
        q_ptrs = q_rows + (k0 // (8 // BITS) + offs_b)[:, None]                # [bytes, BLOCK_N]
        if EVEN_K:
            q = tl.load(q_ptrs)
        else:
            k_mask = cols < K
            q = tl.load(q_ptrs, mask=k_mask[:, None], other=0)
        # The tile's scales (and offsets): one per row where the tile lies inside a group,
        # else gathered per column.
        if GROUP % BLOCK_K == 0:
            s = tl.load(s_rows + k0 // GROUP).to(tl.float32)[None, :]
            if HAS_OFFSET:
                o = tl.load(o_rows + k0 // GROUP).to(tl.float32)[None, :]
        else:
            g = (cols // GROUP)[:, None]
            if EVEN_K:
                s = tl.load(s_rows[None, :] + g).to(tl.float32)
                if HAS_OFFSET:
                    o = tl.load(o_rows[None, :] + g).to(tl.float32)
            else:
                s = tl.load(s_rows[None, :] + g, mask=k_mask[:, None], other=0.0).to(tl.float32)
                if HAS_OFFSET:
                    o = tl.load(o_rows[None, :] + g, mask=k_mask[:, None], other=0.0).to(tl.float32)
        if BITS == 4:
            lo = (q & 0xF).to(tl.float32) * s
            hi = (q >> 4).to(tl.float32) * s
            if HAS_OFFSET:
                lo += o
                hi += o
            if EVEN_K:
                x_lo = tl.load(x_rows + cols[None, :])
                x_hi = tl.load(x_rows + (cols + 16)[None, :])
            else:
                x_lo = tl.load(x_rows + cols[None, :], mask=k_mask[None, :], other=0.0)
                x_hi = tl.load(x_rows + (cols + 16)[None, :], mask=k_mask[None, :], other=0.0)
            acc = tl.dot(x_lo, lo.to(dtype), acc, input_precision=DOT_PREC)
            acc = tl.dot(x_hi, hi.to(dtype), acc, input_precision=DOT_PREC)
        else:
            w = q.to(tl.float32) * s
            if HAS_OFFSET:
                w += o
            if EVEN_K:
                xt = tl.load(x_rows + cols[None, :])
            else:
                xt = tl.load(x_rows + cols[None, :], mask=k_mask[None, :], other=0.0)
            acc = tl.dot(xt, w.to(dtype), acc, input_precision=DOT_PREC)

    if HAS_BIAS:
        # Only the first K split adds the bias (the splits' partial sums are added up after).
        b = tl.load(bias_ptr + n_rows).to(tl.float32)
        acc += tl.where(split == 0, b, 0.0)[None, :]
    c_ptrs = (c_ptr + split.to(tl.int64) * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm
              + offs_n[None, :])
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _group_factor(top_rows, sub_rows, c, mask, BLOCK_S: tl.constexpr, GROUP: tl.constexpr,
                  HAS_SUB: tl.constexpr, EVEN_K: tl.constexpr):
    """The scale (or offset) of the groups of columns c [BK / 2] for the tile's rows [BLOCK_N]:
    float16 per block times int8 per group, float32 [BK / 2, BLOCK_N]."""
    if EVEN_K:
        f = tl.load(top_rows[None, :] + (c // BLOCK_S)[:, None]).to(tl.float32)
        if HAS_SUB:
            f = f * tl.load(sub_rows[None, :] + (c // GROUP)[:, None]).to(tl.float32)
    else:
        f = tl.load(top_rows[None, :] + (c // BLOCK_S)[:, None], mask=mask[:, None], other=0.0).to(tl.float32)
        if HAS_SUB:
            f = f * tl.load(sub_rows[None, :] + (c // GROUP)[:, None], mask=mask[:, None], other=0).to(tl.float32)
    return f


@triton.jit
def _packed_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, ssub_ptr, offset_ptr, osub_ptr, bias_ptr, c_ptr,
    M, N, K, tiles_per_split,
    stride_xm, stride_qn, stride_sn, stride_ssn, stride_on, stride_osn, stride_cs, stride_cm,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_S: tl.constexpr, ZERO: tl.constexpr,
    HAS_SSUB: tl.constexpr, HAS_OFFSET: tl.constexpr, HAS_OSUB: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm
    n_rows = (offs_n % N).to(tl.int64)
    q_rows = q_ptr + n_rows[None, :] * stride_qn
    s_rows = scale_ptr + n_rows * stride_sn
    ss_rows = ssub_ptr + n_rows * stride_ssn
    o_rows = offset_ptr + n_rows * stride_on
    os_rows = osub_ptr + n_rows * stride_osn
    dtype = x_ptr.dtype.element_ty
    RUN_BYTES: tl.constexpr = 4 * BITS
    # The tile's nibble bytes, 16 a run: byte b holds column (b // 16) * 32 + b % 16 (low) and
    # that + 16 (high); `place` is the low column's place in its run.
    offs_b = tl.arange(0, BLOCK_K // 2)
    place = offs_b % 16
    offs_c = (offs_b // 16) * 32 + place

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(first, last):
        k0 = t * BLOCK_K
        cols = k0 + offs_c
        k_mask = cols < K   # K is whole runs: a low column inside K has its high column inside too
        run = (k0 // 32 + offs_b // 16) * RUN_BYTES
        if EVEN_K:
            nib = tl.load(q_rows + (run + place)[:, None]).to(tl.int32)
        else:
            nib = tl.load(q_rows + (run + place)[:, None], mask=k_mask[:, None], other=0).to(tl.int32)
        lo = nib & 0xF
        hi = nib >> 4
        for plane in tl.static_range(BITS - 4):
            at = run + 16 + 4 * plane + place // 8
            if EVEN_K:
                b_lo = tl.load(q_rows + at[:, None]).to(tl.int32)
                b_hi = tl.load(q_rows + (at + 2)[:, None]).to(tl.int32)
            else:
                b_lo = tl.load(q_rows + at[:, None], mask=k_mask[:, None], other=0).to(tl.int32)
                b_hi = tl.load(q_rows + (at + 2)[:, None], mask=k_mask[:, None], other=0).to(tl.int32)
            shift = (place % 8)[:, None]
            lo = lo | (((b_lo >> shift) & 1) << (4 + plane))
            hi = hi | (((b_hi >> shift) & 1) << (4 + plane))
        s_lo = _group_factor(s_rows, ss_rows, cols, k_mask, BLOCK_S, GROUP, HAS_SSUB, EVEN_K)
        s_hi = _group_factor(s_rows, ss_rows, cols + 16, k_mask, BLOCK_S, GROUP, HAS_SSUB, EVEN_K)
        w_lo = (lo - ZERO).to(tl.float32) * s_lo
        w_hi = (hi - ZERO).to(tl.float32) * s_hi
        if HAS_OFFSET:
            w_lo += _group_factor(o_rows, os_rows, cols, k_mask, BLOCK_S, GROUP, HAS_OSUB, EVEN_K)
            w_hi += _group_factor(o_rows, os_rows, cols + 16, k_mask, BLOCK_S, GROUP, HAS_OSUB, EVEN_K)
        if EVEN_K:
            x_lo = tl.load(x_rows + cols[None, :])
            x_hi = tl.load(x_rows + (cols + 16)[None, :])
        else:
            x_lo = tl.load(x_rows + cols[None, :], mask=k_mask[None, :], other=0.0)
            x_hi = tl.load(x_rows + (cols + 16)[None, :], mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x_lo, w_lo.to(dtype), acc, input_precision=DOT_PREC)
        acc = tl.dot(x_hi, w_hi.to(dtype), acc, input_precision=DOT_PREC)

    if HAS_BIAS:
        b = tl.load(bias_ptr + n_rows).to(tl.float32)
        acc += tl.where(split == 0, b, 0.0)[None, :]
    c_ptrs = (c_ptr + split.to(tl.int64) * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm
              + offs_n[None, :])
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@dataclass(frozen=True)
class TilePlan:
    """How one matmul is tiled and launched."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def block_k_for(group: int) -> int:
    """64 columns a tile where the group allows it: a divisor of the group (one scale per row per
    tile) or, for groups 16 and 32, a multiple of it (scales gathered per column); else the
    largest of 32 / 16 that divides the group (a 4-bit group is whole runs of 32, so 32 or 64)."""
    if group % 64 == 0 or 64 % group == 0:
        return 64
    return 32 if group % 32 == 0 else 16


def plan_tiles(m: int, n: int, k: int, group: int, sm_count: int | None,
               dtype: torch.dtype = torch.float16) -> TilePlan:
    """Tiles for an [m, k] x [n, k].T matmul; `sm_count` (None: unknown, e.g. the interpreter)
    decides how far K is split when the M x N tiles are too few to fill the GPU."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    block_n = 128 if block_m == 128 else 64
    block_k = block_k_for(group)
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_tiles = triton.cdiv(k, block_k)
    split_k = 1
    if sm_count and 0 < tiles < sm_count:   # (no rows: no tiles, nothing to split)
        # About two programs per SM, each still walking at least 8 K-tiles.
        split_k = max(1, min(2 * sm_count // tiles, k_tiles // 8, 16))
    # Pipeline stages by shared memory: float32 x tiles are twice the size (a 128 x 128 x 64
    # float32 tile pair at 4 stages would near the H200's 227 KiB).
    num_stages = 2 if dtype == torch.float32 else 3 if block_m <= 64 else 4
    return TilePlan(block_m, block_n, block_k, split_k, num_warps, num_stages)


def _sm_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"quantized linear: activations are {x.dtype}; use float16, bfloat16 or float32")
    if x.dim() == 0 or x.shape[-1] != weight.cols:
        raise ValueError(f"quantized linear: x {tuple(x.shape)} must end in the weight's {weight.cols} columns "
                         f"(weight [{weight.rows}, {weight.cols}])")
    if x.device != weight.device:
        raise ValueError(f"quantized linear: x is on {x.device} but the weight on {weight.device}; move one")
    if weight.bits == 4 and weight.group % NIBBLE_RUN:
        raise ValueError(f"4-bit weight: group {weight.group} is not a multiple of {NIBBLE_RUN}")
    if weight.packed and weight.group % 16:
        raise ValueError(f"{weight.bits}-bit weight: group {weight.group} is not a multiple of 16")
    if weight.bits == 8 and weight.group % 16:
        raise ValueError(f"8-bit weight: group {weight.group} is not a multiple of 16 (the Triton kernel's "
                         f"smallest K-tile); use the torch path (reference_linear) for it")
    if bias is not None and (tuple(bias.shape) != (weight.rows,) or bias.device != weight.device):
        raise ValueError(f"quantized linear: bias {tuple(bias.shape)} on {bias.device} must be "
                         f"[{weight.rows}] on {weight.device}")


def _unit_cols(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def launch(x2d: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, plan: TilePlan) -> torch.Tensor:
    """out [M, N] = x2d [M, K] @ dequant(weight).T (+ bias) with the tiles of `plan`; shapes
    checked by the caller (`quantized_linear`)."""
    m, k = x2d.shape
    n = weight.rows
    out = torch.empty(m, n, dtype=x2d.dtype, device=x2d.device)
    if m == 0 or n == 0:
        return out
    x2d = _unit_cols(x2d)
    q, scale = _unit_cols(weight.q), _unit_cols(weight.scale)
    offset = None if weight.offset is None else _unit_cols(weight.offset)
    k_tiles = triton.cdiv(k, plan.block_k)
    tiles_per_split = triton.cdiv(k_tiles, max(1, min(plan.split_k, k_tiles)))
    split_k = triton.cdiv(k_tiles, tiles_per_split)
    # With split K each split writes a float32 partial sum; summed below.
    target = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x2d.device)
    stride_cs = 0 if split_k == 1 else target.stride(0)
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), split_k)
    if weight.packed:
        if plan.block_k % 32:
            raise ValueError(f"{weight.bits}-bit weight: K-tiles of {plan.block_k} columns are not whole runs of 32")
        ssub, osub = weight.scale_sub, weight.offset_sub
        ssub, osub = _unit_cols(ssub) if ssub is not None else None, _unit_cols(osub) if osub is not None else None

        def stride(t):
            return scale.stride(0) if t is None else t.stride(0)

        _packed_matmul_kernel[grid](
            x2d, q, scale, ssub if ssub is not None else scale, offset if offset is not None else scale,
            osub if osub is not None else scale, bias if bias is not None else scale, target,
            m, n, k, tiles_per_split,
            x2d.stride(0), q.stride(0), scale.stride(0), stride(ssub), stride(offset), stride(osub),
            stride_cs, target.stride(-2),
            BITS=weight.bits, GROUP=weight.group, BLOCK_S=weight.block, ZERO=weight.zero,
            HAS_SSUB=ssub is not None, HAS_OFFSET=offset is not None, HAS_OSUB=osub is not None,
            HAS_BIAS=bias is not None, EVEN_K=k % plan.block_k == 0,
            DOT_PREC="ieee" if x2d.dtype == torch.float32 else "tf32",
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
            num_warps=plan.num_warps, num_stages=plan.num_stages,
        )
        if split_k > 1:
            out.copy_(target.sum(dim=0))
        return out
    _quantized_matmul_kernel[grid](
        x2d, q, scale, offset if offset is not None else scale, bias if bias is not None else scale, target,
        m, n, k, tiles_per_split,
        x2d.stride(0), q.stride(0), scale.stride(0), scale.stride(0) if offset is None else offset.stride(0),
        stride_cs, target.stride(-2),
        BITS=weight.bits, GROUP=weight.group, HAS_OFFSET=offset is not None, HAS_BIAS=bias is not None,
        EVEN_K=k % plan.block_k == 0, DOT_PREC="ieee" if x2d.dtype == torch.float32 else "tf32",
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if split_k > 1:
        out.copy_(target.sum(dim=0))
    return out


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(weight).T (+ bias) -> [..., N] in x's dtype (float16, bfloat16 or
    float32), x on the weight's device; as rein.kernels.quantized.reference_linear."""
    _check(x, weight, bias)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, weight.cols)
    if bias is not None:
        bias = bias.contiguous()
    # (A packed weight's tiles are whole 32-column runs: its groups of 16 or 32 take 64.)
    plan = plan_tiles(x2d.shape[0], weight.rows, weight.cols, weight.group, _sm_count(x.device), x.dtype)
    return launch(x2d, weight, bias, plan).view(*lead, weight.rows)
