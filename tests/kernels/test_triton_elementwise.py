"""The Triton element-wise kernels (rein.kernels.triton_elementwise) against the torch code they
replace in rein.model.architectures.llama and rope. Without a GPU they run under the Triton
interpreter on CPU tensors (TRITON_INTERPRET set before the kernels are defined), tiny shapes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels import triton_elementwise as tew  # noqa: E402
from rein.model.architectures.rope import apply_rotary  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
F32, F16 = torch.float32, torch.float16
TOL = {F32: dict(atol=2e-6, rtol=2e-6), F16: dict(atol=2e-3, rtol=2e-3)}


def torch_rms_norm(x, weight, eps):
    """rein.model.architectures.llama.RMSNorm's torch branch."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return weight * xf.to(dtype) if dtype != F32 else xf * weight


def rand(*shape, dtype=F32, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("cols", [64, 100])   # a power of two and not (masked tail)
def test_rms_norm(dtype, cols):
    x, w = rand(5, cols, dtype=dtype), rand(cols, dtype=dtype, seed=1)
    torch.testing.assert_close(tew.rms_norm(x, w, 1e-6), torch_rms_norm(x, w, 1e-6), **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16])
def test_add_rms_norm_updates_the_residual(dtype):
    residual, x, w = rand(4, 48, dtype=dtype), rand(4, 48, dtype=dtype, seed=1), rand(48, dtype=dtype, seed=2)
    want_sum = residual + x
    want = torch_rms_norm(want_sum, w, 1e-5)
    got = tew.add_rms_norm(residual, x, w, 1e-5)
    torch.testing.assert_close(residual, want_sum, **TOL[dtype])
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16])
def test_silu_and_mul(dtype):
    gate_up = rand(3, 2 * 40, dtype=dtype)
    gate, up = gate_up.split(40, dim=-1)
    torch.testing.assert_close(tew.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16])
def test_gelu_tanh_and_mul(dtype):
    gate_up = rand(3, 2 * 40, dtype=dtype)
    gate, up = gate_up.split(40, dim=-1)
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up   # Gemma 3's GeluMLP
    torch.testing.assert_close(tew.gelu_tanh_and_mul(gate_up), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16])
def test_rotary_in_place_on_the_fused_projection(dtype):
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 16
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)   # strided, as the model
    angles = rand(tokens, 1, head_dim // 2, seed=3)
    cos, sin = angles.cos(), angles.sin()
    want = apply_rotary(qk.clone(), cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    assert tew.rotary_(qk, cos, sin)
    torch.testing.assert_close(qk, want, **TOL[dtype])
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim:], v_before, rtol=0, atol=0)   # V untouched


def test_declines_what_it_does_not_handle():
    x = rand(4, 8, 6)
    assert tew.rms_norm(x.transpose(0, 1), rand(6), 1e-6) is None      # neither 2-D nor contiguous
    assert tew.silu_and_mul(rand(4, 8).t()) is None                      # column stride != 1
    assert tew.rotary_(rand(3, 2, 8).transpose(1, 2), rand(3, 1, 4), rand(3, 1, 4)) is False
