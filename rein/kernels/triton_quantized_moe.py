"""Fused mixture-of-experts on CUDA with the experts held quantized: the routed experts of a
step as two grouped GEMMs over rein.kernels.quantized_experts' stacked `QuantizedWeight`s.

rein.kernels.triton_moe's fused MoE with its weight tiles read as triton_quantized's are:

* the (token, expert) pairs are sorted by expert and padded to whole BLOCK_M tiles by
  triton_moe's `align_by_expert` (on the device, no host sync: CUDA-graph capturable), so every
  tile of rows belongs to one expert;
* a program computes one [BLOCK_M, BLOCK_N] tile of A[rows] @ W_e.T, where W_e is rows
  e * N ... (e + 1) * N of the stacked weight: it walks K in BLOCK_K steps, loads the tile's
  integers and scales, dequantizes them in float32 to the activations' dtype in registers and
  multiplies with `tl.dot` (4-bit runs as two dots, the low and the high nibbles' columns, as
  triton_quantized explains), accumulating in float32; the A rows are gathered through the
  sorted pair ids and the results scattered back to the pairs' rows (sentinel rows masked);
* launched once for gate/up (rows per token k: the pair's token row of x) and once for down
  (the pair's own SiLU-and-multiply row, scaled by its routing weight); the k rows of each
  token are summed at the end.

The reference is rein.kernels.quantized_experts.grouped_quantized_experts on the dequantized
experts (tests/kernels/test_triton_quantized_moe.py, under the Triton interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.kernels import triton_elementwise
from rein.kernels.quantized import QuantizedWeight
from rein.kernels.quantized_experts import QuantizedExperts, check_expert_pair
from rein.kernels.triton_moe import align_by_expert
from rein.kernels.triton_quantized import block_k_for

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _grouped_quantized_kernel(
    a_ptr, q_ptr, scale_ptr, offset_ptr, c_ptr, weight_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
    N, K, num_pairs,
    stride_am, stride_qn, stride_sn, stride_on, stride_cm,
    ROWS_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    if pid_m * BLOCK_M >= tl.load(padded_ptr):
        return   # past the last expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m).to(tl.int64)
    valid = pairs < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    a_rows = a_ptr + (pairs // ROWS_PER_TOKEN)[:, None] * stride_am            # [BLOCK_M, 1]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Columns past N wrap onto real rows of this expert (loads need no mask; the store has one).
    w_rows = expert * N + (offs_n % N).to(tl.int64)                           # rows of the stacked weight
    q_rows = q_ptr + w_rows[None, :] * stride_qn                               # [1, BLOCK_N]
    s_rows = scale_ptr + w_rows * stride_sn                                    # [BLOCK_N]
    o_rows = offset_ptr + w_rows * stride_on
    dtype = a_ptr.dtype.element_ty
    offs_b = tl.arange(0, BLOCK_K // (8 // BITS))   # bytes of the tile's integers, per row
    if BITS == 4:
        offs_c = (offs_b // 16) * 32 + offs_b % 16  # the low nibbles' columns (high: + 16)
    else:
        offs_c = offs_b

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_c
        k_mask = cols < K
        q = tl.load(q_rows + (k0 // (8 // BITS) + offs_b)[:, None], mask=k_mask[:, None], other=0)
        if GROUP % BLOCK_K == 0:
            s = tl.load(s_rows + k0 // GROUP).to(tl.float32)[None, :]
            if HAS_OFFSET:
                o = tl.load(o_rows + k0 // GROUP).to(tl.float32)[None, :]
        else:
            g = (cols // GROUP)[:, None]
            s = tl.load(s_rows[None, :] + g, mask=k_mask[:, None], other=0.0).to(tl.float32)
            if HAS_OFFSET:
                o = tl.load(o_rows[None, :] + g, mask=k_mask[:, None], other=0.0).to(tl.float32)
        a_mask = valid[:, None] & k_mask[None, :]
        if BITS == 4:
            lo = (q & 0xF).to(tl.float32) * s
            hi = (q >> 4).to(tl.float32) * s
            if HAS_OFFSET:
                lo += o
                hi += o
            x_lo = tl.load(a_rows + cols[None, :], mask=a_mask, other=0.0)
            x_hi = tl.load(a_rows + (cols + 16)[None, :], mask=a_mask, other=0.0)
            acc = tl.dot(x_lo, lo.to(dtype), acc, input_precision=DOT_PREC)
            acc = tl.dot(x_hi, hi.to(dtype), acc, input_precision=DOT_PREC)
        else:
            w = q.to(tl.float32) * s
            if HAS_OFFSET:
                w += o
            xt = tl.load(a_rows + cols[None, :], mask=a_mask, other=0.0)
            acc = tl.dot(xt, w.to(dtype), acc, input_precision=DOT_PREC)
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped_gemm(a: torch.Tensor, weight: QuantizedWeight, rows_per_expert: int, out: torch.Tensor,
                  sorted_ids: torch.Tensor, block_experts: torch.Tensor, padded_total: torch.Tensor,
                  num_pairs: int, rows_per_token: int, weights: torch.Tensor | None, block_m: int) -> None:
    """out[pairs] = a[pair rows] @ dequant(expert rows of `weight`).T (x the routing weight)."""
    if a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("fused quantized MoE needs rows with unit column stride")
    n, k = rows_per_expert, weight.cols
    q, scale = weight.q.contiguous(), weight.scale.contiguous()
    offset = None if weight.offset is None else weight.offset.contiguous()
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    grid = (block_experts.numel() * triton.cdiv(n, block_n),)
    _grouped_quantized_kernel[grid](
        a, q, scale, offset if offset is not None else scale, out, weights if weights is not None else out,
        sorted_ids, block_experts, padded_total,
        n, k, num_pairs,
        a.stride(0), q.stride(0), scale.stride(0), scale.stride(0) if offset is None else offset.stride(0),
        out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, MUL_WEIGHT=weights is not None,
        BITS=weight.bits, GROUP=weight.group, HAS_OFFSET=offset is not None,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k_for(weight.group),
    )


def fused_quantized_experts(x: torch.Tensor, gate_up: QuantizedExperts, down: QuantizedExperts,
                            weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]): x [T, H], gate_up [E, 2I, H] and down
    [E, H, I] stacked QuantizedExperts on x's device, weights and ids [T, k] -> [T, H]."""
    tokens, hidden = x.shape
    check_expert_pair(gate_up, down, hidden)
    if gate_up.stacked is None or down.stacked is None:
        raise ValueError("fused quantized MoE needs the experts' stacked form (not CPU panels)")
    if x.dtype not in _DTYPES:
        raise ValueError(f"fused quantized MoE: activations are {x.dtype}; use float16, bfloat16 or float32")
    if weights.shape != ids.shape or ids.shape[0] != tokens:
        raise ValueError(f"routing weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [{tokens}, k]")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_experts, two_inter = gate_up.num_experts, gate_up.rows
    top_k = ids.shape[1]
    num_pairs = tokens * top_k
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_ids, block_experts, padded_total = align_by_expert(ids, num_experts, block_m)
    gate_up_out = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up.stacked, two_inter, gate_up_out, sorted_ids, block_experts, padded_total,
                  num_pairs, top_k, None, block_m)
    hidden_act = triton_elementwise.silu_and_mul(gate_up_out)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden_act, down.stacked, hidden, out, sorted_ids, block_experts, padded_total,
                  num_pairs, 1, weights.reshape(-1).to(torch.float32).contiguous(), block_m)
    return out.view(tokens, top_k, hidden).sum(dim=1)
