"""The small-M split-K GEMM (rein.kernels.triton_small_gemm) against torch.nn.functional.linear.
Without a GPU it runs under the Triton interpreter on CPU tensors (TRITON_INTERPRET set before
the kernels are defined), tiny shapes; bf16 only on a GPU (the interpreter's bf16 tl.dot is not
trustworthy)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels.triton_small_gemm import (  # noqa: E402
    MAX_ROWS,
    choose_split_k,
    silu_and_mul_linear,
    small_m_linear,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
BF16_ON_GPU = pytest.param(BF16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="interpreter bf16 tl.dot"))
TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=2e-2, rtol=1e-2), BF16: dict(atol=5e-2, rtol=2e-2)}


def rand(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def want(x, w, b):
    """F.linear in float32 from the same rounded inputs, rounded once to the activation dtype."""
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16_ON_GPU])
@pytest.mark.parametrize("rows, n, k, split_k", [
    (1, 40, 96, None),     # one row, N not a multiple of the tile, chosen splits
    (5, 72, 200, 3),       # K cut into 3 splits, the last one short
    (17, 33, 64, 1),       # one split: the main kernel writes the output itself
])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_linear(dtype, rows, n, k, split_k, bias):
    x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype, seed=1)
    b = rand(n, dtype=dtype, seed=2) if bias else None
    got = small_m_linear(x, w, b, block_n=32, block_k=32, split_k=split_k)
    torch.testing.assert_close(got, want(x, w, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16, BF16_ON_GPU])
@pytest.mark.parametrize("split_k", [1, 3])
def test_silu_and_mul_folded_into_the_down_projection(dtype, split_k):
    inter, n = 80, 24
    gate_up, w = rand(6, 2 * inter, dtype=dtype), rand(n, inter, dtype=dtype, seed=1)
    gate, up = gate_up.split(inter, dim=-1)
    hidden = torch.nn.functional.silu(gate) * up   # the MLP's unfused path (two roundings)
    got = silu_and_mul_linear(gate_up, w, block_n=16, block_k=16, split_k=split_k)
    torch.testing.assert_close(got, want(hidden, w, None), **TOL[dtype])


def test_keeps_leading_dimensions():
    x, w = rand(2, 3, 64), rand(24, 64, seed=1)
    got = small_m_linear(x, w, block_n=16, block_k=32, split_k=2)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, want(x, w, None), **TOL[F32])


def test_declines_what_it_does_not_take():
    w = rand(16, 32)
    assert small_m_linear(rand(MAX_ROWS + 1, 32), w) is None    # a prefill's rows: cuBLAS
    assert small_m_linear(rand(4, 32, dtype=F16), w) is None     # dtypes differ
    assert small_m_linear(rand(4, 32), rand(32, 16).t()) is None  # a transposed weight


def test_split_k_fills_the_sms_with_tiles_of_at_least_two_k_blocks():
    assert choose_split_k(n_blocks=264, k=4096, block_k=128, sm_count=132) == 1   # enough programs already
    assert choose_split_k(n_blocks=14, k=896, block_k=128, sm_count=132) == 3     # 896 / 256
    assert choose_split_k(n_blocks=64, k=14336, block_k=128, sm_count=132) == 5   # 2 * 132 / 64
