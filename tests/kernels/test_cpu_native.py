"""The native CPU decode attention (rein.kernels.cpu_native) against the torch reference.

The kernel is built with the machine's C compiler on first use; every machine rein's tests
run on has one (gcc), so a failed build fails these tests rather than skipping them.
"""

import logging

import pytest
import torch

from rein import kernels
from rein.core.settings import get_settings
from rein.kernels import cpu_native, reference


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Build into this test's directory; forget any library loaded by an earlier test."""
    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path))
    get_settings.cache_clear()
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    yield
    get_settings.cache_clear()


def make_case(lengths, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """Random query and paged cache; each request's blocks scattered, table padding -1."""
    g = torch.Generator().manual_seed(seed)
    per = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(per) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(lengths), max(per) + 2), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per):
        tables[i, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=g) * 2
    return q, k, v, tables, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),     # SmolLM2-135M
    (4, 4, 32, 4),      # no grouping, tiny blocks
    (14, 2, 64, 16),    # Qwen2.5-0.5B's group of 7
    (8, 1, 128, 8),     # one kv head, wide heads
])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    lengths = [1, 2, block_size, block_size + 1, 37, 300]
    q, k, v, tables, lens = make_case(lengths, num_heads, num_kv_heads, head_dim, block_size)
    got = cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.125)
    assert got is not None, "the native kernel did not build or load"
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_large_scores_stay_finite():
    """Scores far apart (softmax dominated by one token, others underflow) match too."""
    q, k, v, tables, lens = make_case([64, 5], 9, 3, 64, 16, seed=3)
    q = q * 40
    got = cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.125)
    want = reference.paged_decode_attention(q, k, v, tables, lens, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_non_contiguous_query_and_wide_tables():
    q, k, v, tables, lens = make_case([20, 70, 3], 6, 2, 32, 16, seed=5)
    wide = torch.cat([q, q], dim=-1)[..., :32]        # a strided view, as a qkv split gives
    tables = torch.cat([tables, torch.full((3, 5), -1, dtype=torch.int32)], dim=1).long()
    got = cpu_native.paged_decode_attention(wide, k, v, tables, lens.long(), 0.2)
    torch.testing.assert_close(got, reference.paged_decode_attention(q, k, v, tables, lens, 0.2),
                               atol=2e-5, rtol=1e-5)


def test_other_dtypes_decline():
    q, k, v, tables, lens = make_case([10], 4, 2, 32, 16)
    assert cpu_native.paged_decode_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens, 0.1) is None


def test_dispatch_uses_it_and_the_setting_turns_it_off(monkeypatch, tmp_path):
    q, k, v, tables, lens = make_case([10, 40], 4, 2, 32, 16)
    calls = []
    real = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a: calls.append(1) or real(*a))
    kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    assert calls and cpu_native._lib is not None
    assert list((tmp_path / "kernels").glob("paged_attention_cpu-*.so"))

    monkeypatch.setenv("REIN_CPU_KERNELS", "0")
    get_settings.cache_clear()
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    assert cpu_native.library() is None
    out = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.1))


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    q, k, v, tables, lens = make_case([10], 4, 2, 32, 16)
    with caplog.at_level(logging.WARNING, logger="rein.kernels.cpu_native"):
        assert cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.1) is None
        assert cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.1) is None
    assert [r.message for r in caplog.records if "unavailable" in r.message] == [
        "native CPU attention kernels unavailable, using torch's (no C compiler (cc or gcc) on PATH)"]
    out = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.1))
