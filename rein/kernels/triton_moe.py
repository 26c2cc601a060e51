"""Fused mixture-of-experts on CUDA: the routed experts of a step as two grouped GEMMs.

A step's T tokens each go to k experts: T * k (token, expert) pairs. As vLLM's fused_moe:

1. `align_by_expert` sorts the pairs by expert and pads each expert's run to a multiple of
   BLOCK_M with a sentinel pair (T * k), so every BLOCK_M-row tile of the sorted list
   belongs to one expert; `block_experts[b]` names it. All on the device, without a host
   sync (CUDA-graph capturable): the grid is sized for the worst case, T * k + E * (BLOCK_M - 1)
   rows, and tiles past the padded total return at once.
2. `_grouped_gemm_kernel` computes one [BLOCK_M, BLOCK_N] tile of `A[rows] @ W[expert].T`,
   gathering its A rows through the sorted pair ids (row = pair // k for the tokens, the
   pair itself for per-pair activations) and scattering the result back to the pairs' rows;
   sentinel rows are masked out. Launched once for gate/up ([E, 2I, H]) and once for down
   ([E, H, I]), the second scaling each row by its routing weight.
3. SiLU-and-multiply between the two (rein.kernels.triton_elementwise), and the k rows of
   each token summed at the end.

The torch reference is rein.model.architectures.moe.grouped_experts (tests/kernels/test_triton_moe.py
compares them under the Triton interpreter). float32 runs IEEE products (tf32 would lose
about three decimal digits against the reference); fp16/bf16 accumulate in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.kernels import triton_elementwise


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weight_ptr, sorted_ptr, block_expert_ptr, padded_ptr,
    N, K, num_pairs,
    stride_am, stride_we, stride_wn, stride_wk, stride_cm,
    ROWS_PER_TOKEN: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PREC: tl.constexpr,
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
    rows = pairs // ROWS_PER_TOKEN
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(sorted pair ids padded per expert to whole BLOCK_M tiles with the sentinel T * k,
    the expert of each tile, the padded total as a 1-element tensor), without a host sync."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    # A pair's rank within its expert's run: its sorted position minus where the run starts.
    run_starts = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=ids.device) - run_starts[sorted_experts]
    dest = (padded_ends - padded)[sorted_experts] + rank
    capacity = num_pairs + num_experts * (block_m - 1)
    sorted_ids = torch.full((triton.cdiv(capacity, block_m) * block_m,), num_pairs, dtype=torch.int32,
                            device=ids.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, sorted_ids.numel(), block_m, device=ids.device)
    # Tiles past the padded total get a clamped expert; the kernel returns before using it.
    block_experts = torch.searchsorted(padded_ends, tile_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, block_experts.to(torch.int32), padded_ends[-1:]


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                  block_experts: torch.Tensor, padded_total: torch.Tensor, num_pairs: int, rows_per_token: int,
                  weights: torch.Tensor | None, block_m: int) -> None:
    _, n, k = w.shape
    if a.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("fused MoE needs rows with unit column stride")
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.numel() * triton.cdiv(n, block_n),)
    _grouped_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out, sorted_ids, block_experts, padded_total,
        n, k, num_pairs,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, MUL_WEIGHT=weights is not None,
        DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]): x [T, H], gate_up_proj [E, 2I, H],
    down_proj [E, H, I], weights [T, k], ids [T, k] -> [T, H]; as grouped_experts."""
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up_proj.shape
    top_k = ids.shape[1]
    if gate_up_proj.shape[2] != hidden or down_proj.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert shapes {tuple(gate_up_proj.shape)} / {tuple(down_proj.shape)} "
                         f"do not fit hidden size {hidden}")
    if weights.shape != ids.shape or ids.shape[0] != tokens:
        raise ValueError(f"routing weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be [{tokens}, k]")
    if x.stride(1) != 1:
        x = x.contiguous()
    num_pairs = tokens * top_k
    # Decode-sized steps waste less padding on 16-row tiles; prefill fills 64-row ones.
    block_m = 16 if num_pairs <= 16 * num_experts else 64
    sorted_ids, block_experts, padded_total = align_by_expert(ids, num_experts, block_m)
    gate_up = torch.empty(num_pairs, two_inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up_proj, gate_up, sorted_ids, block_experts, padded_total, num_pairs, top_k, None, block_m)
    hidden_act = triton_elementwise.silu_and_mul(gate_up)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(hidden_act, down_proj, out, sorted_ids, block_experts, padded_total, num_pairs, 1,
                  weights.reshape(-1).to(torch.float32).contiguous(), block_m)
    return out.view(tokens, top_k, hidden).sum(dim=1)
