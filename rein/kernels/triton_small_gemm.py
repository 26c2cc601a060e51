"""A Triton GEMM for the few-row matmuls of a decode step (M <= 64 rows): split-K so that even a
narrow projection puts a program on every SM, and each weight byte is read once.

At decode a projection is x [M, K] @ W[N, K]^T with M the batch (1-64) and the weight in HBM:
the matmul is bound by reading W, and what decides its time is whether enough programs stream
W at once. cuBLAS chooses tiles for general shapes; on an H200 a Qwen2-0.5B-shaped decode step's
four GEMMs took 24 us a layer, against the ~6 us its 30 MB of bf16 weights take to read at 4.8 TB/s (docs/benchmarks.md,
"Decode against the HBM bound"). Here:
  * one program owns BLOCK_N output columns for all M rows (one [BLOCK_M, BLOCK_N] fp32
    accumulator, M padded to 16 for tl.dot) and a 1/split_k share of K; W tiles are read
    [BLOCK_N, BLOCK_K] with K contiguous, as the nn.Linear weight is stored;
  * `silu_and_mul_linear` feeds the down projection straight from gate_up: SiLU(gate) * up is
    computed as each x tile is loaded (rounded as rein.kernels.triton_elementwise rounds it), so
    a decode step's MLP loses the separate SiLU-and-multiply kernel and its round trip;
  * split_k is chosen so that about TARGET_WAVES x SMs programs exist; with split_k > 1 each
    program writes an fp32 partial sum and `_reduce_kernel` adds the splits, the bias, and
    rounds to the activation dtype once (a second launch; no atomics, so results are
    deterministic and the kernels CUDA-graph capturable: no host synchronization).

Which of cuBLAS and this kernel wins is measured on the device, not assumed: the model calls it
only when selected (rein.model.architectures.linear, REIN_CUDA_SMALL_GEMM=triton); the default
is cuBLAS. `small_m_linear` takes the tile sizes as keywords so a GPU check can sweep them.
Tested under the Triton interpreter (tests/kernels/test_triton_small_gemm.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 64
TARGET_WAVES = 2
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132   # the interpreter (tests): an H100's count
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@triton.jit
def _small_m_gemm_kernel(
    X, W, BIAS, OUT, PART,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SILU_AND_MUL: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    w_rows = W + cols.to(tl.int64)[:, None] * stride_wn   # N * K can pass 2**31 (a vocabulary head)
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        x_mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
        if SILU_AND_MUL:
            # X is gate_up [M, 2K]: x = silu(gate) * up, each rounded to the activation dtype.
            up = tl.load(X + rows[:, None] * stride_xm + K + ks[None, :], mask=x_mask, other=0.0)
            gate = x.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(x.dtype).to(tl.float32)
            x = (silu * up.to(tl.float32)).to(x.dtype)
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT:
        tl.store(PART + split * stride_ps + rows[:, None] * stride_pm + cols[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(BIAS + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(OUT + rows[:, None] * stride_om + cols[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(PART, BIAS, OUT, N, splits, stride_ps, stride_pm, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(PART + s * stride_ps + row * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=mask)


def choose_split_k(n_blocks: int, k: int, block_k: int, sm_count: int) -> int:
    """Splits of K so that n_blocks * splits reaches TARGET_WAVES programs per SM, each split
    at least two K tiles long (shorter ones spend more on the partial sums than they gain)."""
    want = triton.cdiv(TARGET_WAVES * sm_count, max(n_blocks, 1))
    return max(1, min(want, k // (2 * block_k)))


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                   block_n: int = 64, block_k: int = 128, split_k: int | None = None,
                   num_warps: int = 4, num_stages: int = 4) -> torch.Tensor | None:
    """x [..., K] @ weight[N, K]^T (+ bias) as torch.nn.functional.linear, for at most MAX_ROWS
    rows; None where it does not apply (more rows, a dtype mismatch, a strided weight): the
    caller runs F.linear. Keywords: tiles and splits (split_k None: choose_split_k), for sweeps."""
    return _launch(x, x.shape[-1], weight, bias, False, block_n, block_k, split_k, num_warps, num_stages)


def silu_and_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, *, block_n: int = 64, block_k: int = 128,
                        split_k: int | None = None, num_warps: int = 4,
                        num_stages: int = 4) -> torch.Tensor | None:
    """(silu(gate) * up) @ weight[N, I]^T for gate_up [M, 2I] (gate first), at most MAX_ROWS rows,
    as silu_and_mul followed by F.linear; None where small_m_linear would decline."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        return None
    return _launch(gate_up, gate_up.shape[1] // 2, weight, None, True, block_n, block_k, split_k, num_warps,
                   num_stages)


def _launch(x: torch.Tensor, k: int, weight: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool,
            block_n: int, block_k: int, split_k: int | None, num_warps: int, num_stages: int) -> torch.Tensor | None:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > MAX_ROWS or weight.dim() != 2 or weight.shape[1] != k or x.dtype not in DTYPES
            or weight.dtype != x.dtype or not weight.is_contiguous() or x.device != weight.device
            or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
        return None
    x2 = x.reshape(rows, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, block_n)
    splits = split_k if split_k is not None else choose_split_k(n_blocks, k, block_k, _sm_count(x.device))
    # Whole K tiles per split, so no tile straddles two splits.
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    part = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    bias_arg = bias if bias is not None else out   # a dummy pointer when there is no bias
    # fp32 activations: IEEE products, as F.linear's fp32 default (tf32 off) computes them.
    dot_prec = "ieee" if x.dtype == torch.float32 else "tf32"
    _small_m_gemm_kernel[(n_blocks, splits)](
        x2, weight, bias_arg, out, part,
        rows, n, k, k_per_split,
        x2.stride(0), weight.stride(0), out.stride(0), part.stride(0) if splits > 1 else 0,
        part.stride(1) if splits > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, SILU_AND_MUL=silu_and_mul, DOT_PREC=dot_prec,
        BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages,
    )
    if splits > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(rows, triton.cdiv(n, block))](
            part, bias_arg, out, n, splits, part.stride(0), part.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], n)
