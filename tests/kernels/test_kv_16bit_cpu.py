"""The C attention kernels reading a float16 or bfloat16 KV cache (rein.kernels.cpu_native,
csrc/kv_types.h), for each build: AVX-512 (this CPU, where it has it), AVX2+FMA+F16C
(-march=haswell) and the x86-64 baseline's plain loops.

The kernels widen K and V to float32 exactly, so their outputs are compared tightly with the
float32 reference over the same rounded K and V; the 16-bit rounding itself is the engine
test's business (tests/unit/test_kv_cache_dtypes.py).
"""

import pytest
import torch
from kernel_builds import use_c_kernels
from test_cpu_native import HEAD_LAYOUTS, make_case, make_prefill_case, off_prefill_panel

from rein import kernels
from rein.core.settings import get_settings
from rein.kernels import cpu_native, reference

DTYPES = [torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kv16-kernels")


@pytest.fixture(autouse=True, params=["native", "haswell", "x86-64"])
def march(request, build_root, monkeypatch):
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def rounded(k, v, dtype):
    """The caches in `dtype`, and the same values widened back to float32 for the reference."""
    k16, v16 = k.to(dtype), v.to(dtype)
    return k16, v16, k16.float(), v16.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEAD_LAYOUTS)
@pytest.mark.parametrize("window", [None, 20])
def test_decode_reads_16bit_caches(dtype, num_heads, num_kv_heads, head_dim, block_size, window, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    q, k, v, tables, lens = make_case([1, 2, block_size + 1, 37, 300], num_heads, num_kv_heads, head_dim, block_size)
    k16, v16, k32, v32 = rounded(k, v, dtype)
    got = cpu_native.paged_decode_attention(q, k16, v16, tables, lens, 0.125, window=window)
    assert got is not None, "the native kernel declined a 16-bit cache"
    want = reference.paged_decode_attention(q, k32, v32, tables, lens, 0.125, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEAD_LAYOUTS)
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_reads_16bit_caches(dtype, num_heads, num_kv_heads, head_dim, block_size, window, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    query, k, v, tables, cu, lens = make_prefill_case([1, 5, 37, 70], [1, 60, 37, 300], num_heads, num_kv_heads,
                                                      head_dim, block_size)
    k16, v16, k32, v32 = rounded(k, v, dtype)
    got = cpu_native.paged_prefill_attention(query, k16, v16, tables, cu, lens, 0.125, window=window)
    if off_prefill_panel(head_dim):
        assert got is None
        return
    assert got is not None, "the native kernel declined a 16-bit cache"
    want = reference.paged_prefill_attention(query, k32, v32, tables, cu, lens, 0.125, window=window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_then_attend_through_the_dispatch(dtype):
    """kernels.store_kv rounds float32 K/V into the 16-bit cache (round to nearest even, torch's
    conversion), and the dispatch runs the native kernels on it."""
    q, k, v, tables, lens = make_case([40], 6, 2, 64, 16)
    k16, v16 = torch.zeros_like(k, dtype=dtype), torch.zeros_like(v, dtype=dtype)
    slots = torch.cat([tables[0, t // 16:t // 16 + 1] * 16 + t % 16 for t in range(40)]).long()
    fresh_k = torch.randn(40, 2, 64)
    fresh_v = torch.randn(40, 2, 64)
    kernels.store_kv(fresh_k, fresh_v, k16, v16, slots)
    assert torch.equal(k16.view(-1, 2, 64)[slots], fresh_k.to(dtype))
    got = kernels.paged_decode_attention(q[:1], k16, v16, tables, lens, 0.125)
    want = reference.paged_decode_attention(q[:1], k16.float(), v16.float(), tables, lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_mixed_or_other_cache_types_decline():
    q, k, v, tables, lens = make_case([10], 4, 2, 32, 16)
    assert cpu_native.paged_decode_attention(q, k.half(), v.bfloat16(), tables, lens, 0.1) is None
    assert cpu_native.paged_decode_attention(q, k.double(), v.double(), tables, lens, 0.1) is None
    assert cpu_native.paged_decode_attention(q.half(), k.half(), v.half(), tables, lens, 0.1) is None
