"""Rotary and the KV store in one C call (csrc/rotary_store_cpu.c through
rein.kernels.rotary_store_kv) against the separate steps it replaces (rein.kernels.reference's
rotary and store_kv), for each cache type, in each build a CPU may get: this CPU's, AVX2 without
AVX-512 (-march=haswell) and the x86-64 baseline's plain loops."""

import pytest
import torch
from kernel_builds import use_c_kernels

from rein import kernels
from rein.core.settings import get_settings
from rein.kernels import cpu_native, reference
from rein.model.architectures.rope import apply_rotary

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 32, 4


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("rotary-store-kernels")


@pytest.fixture(autouse=True, params=["native", "haswell", "x86-64"])
def march(request, build_root, monkeypatch):
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def projection(tokens, seed=0):
    """q, k, v as views of one fused projection's rows, as the Llama layer makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
    angles = torch.rand(tokens, 1, HEAD_DIM // 2, generator=gen) * 6.0
    return q, k, v, angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_rotates_and_stores_as_the_separate_steps(dtype, tokens):
    q, k, v, cos, sin = projection(tokens)
    blocks = -(-tokens // BLOCK) + 2
    slots = torch.randperm(blocks * BLOCK)[:tokens]
    slots[tokens // 2] = -1   # a padding row: rotated, not stored
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_kc = torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    want_vc = torch.zeros_like(want_kc)
    reference.store_kv(want_k, v, want_kc, want_vc, slots)
    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)

    assert kernels.rotary_store_kv(q, k, v, cos, sin, kc, vc, slots)

    # The C rotation may fuse a multiply-add where torch rounds twice: within a float32 ulp or two.
    torch.testing.assert_close(q, want_q, rtol=0, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=0, atol=1e-6)
    assert torch.equal(vc, want_vc)
    torch.testing.assert_close(kc.float(), want_kc.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 8e-3)
    if dtype != torch.float32:   # narrowed from nearly the same floats: equal but at a rounding boundary
        assert int((kc != want_kc).sum()) <= tokens * KV_HEADS * HEAD_DIM // 50


def test_rotation_is_the_rotary_kernels():
    """The Llama layer's float32 answers stay what they were: the fused call rotates exactly as
    the in-place rotary kernel it replaces there."""
    q, k, v, cos, sin = projection(7)
    qk = torch.cat([q, k], dim=1)
    assert cpu_native.rotary_(qk, cos, sin)
    kc = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    assert cpu_native.rotary_store_kv(q, k, v, cos, sin, kc, torch.zeros_like(kc), torch.arange(7))
    assert torch.equal(torch.cat([q, k], dim=1), qk)
    assert torch.equal(kc.view(-1, KV_HEADS, HEAD_DIM)[:7], qk[:, HEADS:])


def test_bfloat16_rounds_to_nearest_even_as_torch():
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 3.0e38, float("inf"), float("nan"),
                           1e-40, -0.0] * (KV_HEADS * HEAD_DIM // 8))
    v = values.view(1, KV_HEADS, HEAD_DIM)
    q, k = torch.zeros(1, HEADS, HEAD_DIM), torch.zeros(1, KV_HEADS, HEAD_DIM)
    cos, sin = torch.ones(1, 1, HEAD_DIM // 2), torch.zeros(1, 1, HEAD_DIM // 2)
    kc = torch.zeros(1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    assert kernels.rotary_store_kv(q, k, v, cos, sin, kc, vc, torch.tensor([2]))
    got, want = vc[0, 2], v[0].to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())   # NaN stays NaN (torch's own payload varies by path)
    assert torch.equal(got[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))


def test_declines_what_it_does_not_take():
    q, k, v, cos, sin = projection(3)
    kc = torch.zeros(2, BLOCK, KV_HEADS, HEAD_DIM)
    slots = torch.arange(3)
    before = q.clone()
    assert not kernels.rotary_store_kv(q, k, v, cos, sin, kc.to(torch.int8), kc.to(torch.int8), slots,
                                       torch.ones(2, BLOCK, KV_HEADS), torch.ones(2, BLOCK, KV_HEADS))
    assert not cpu_native.rotary_store_kv(q.double(), k, v, cos, sin, kc, kc.clone(), slots)
    assert not cpu_native.rotary_store_kv(q, k, v, cos, sin, kc, kc.clone(), slots.int())
    assert not cpu_native.rotary_store_kv(q, k, v, cos, sin, kc.double(), kc.double(), slots)
    assert not cpu_native.rotary_store_kv(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, cos, sin, kc,
                                          kc.clone(), slots)
    assert not cpu_native.rotary_store_kv(q, k, v, cos[:2], sin[:2], kc, kc.clone(), slots)
    assert torch.equal(q, before) and not kc.any()
