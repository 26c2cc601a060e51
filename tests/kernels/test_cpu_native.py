"""The native CPU kernels (rein.kernels.cpu_native) against torch: decode and prefill attention
against the reference, and the fused element-wise ops against the torch code they replace.

The kernel is built with the machine's C compiler on first use; every machine rein's tests
run on has one (gcc), so a failed build fails these tests rather than skipping them.
"""

import logging

import pytest
import torch
from kernel_builds import use_c_kernels

from rein import kernels
from rein.core.settings import get_settings
from rein.kernels import cpu_native, cpu_paths, reference
from rein.model.architectures.rope import apply_rotary


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


@pytest.fixture(autouse=True, params=["native", "x86-64"], ids=["native", "portable"])
def march(request, build_root, monkeypatch):
    """Every test twice: built for this CPU (its AVX2/AVX-512 code where it has them), and for
    the x86-64 baseline, whose plain loops are what a CPU without AVX2 runs. Each build is
    made once into this module's directory; any library loaded by an earlier test is forgotten."""
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def test_instruction_set_follows_the_build(march):
    features = cpu_paths.cpu_features()
    if march == "x86-64":
        want = "portable C"
    elif "avx512f" in features:
        want = "avx512f+avx2+fma"
    else:
        want = "avx2+fma" if {"avx2", "fma"} <= set(features) else "portable C"
    assert cpu_native.instruction_set() == want


HEAD_LAYOUTS = [
    (9, 3, 64, 16),     # SmolLM2-135M
    (4, 4, 32, 4),      # no grouping, tiny blocks
    (14, 2, 64, 16),    # Qwen2.5-0.5B's group of 7
    (8, 1, 128, 8),     # one kv head, wide heads
    (4, 2, 16, 12),     # the tiny test model's heads; a block size no power of two
]


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


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEAD_LAYOUTS)
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


@pytest.mark.parametrize("setting", ["REIN_CPU_KERNELS", "REIN_CPU_FAST_PATHS"])
def test_dispatch_uses_it_and_the_settings_turn_it_off(setting, monkeypatch, build_root):
    q, k, v, tables, lens = make_case([10, 40], 4, 2, 32, 16)
    calls = []
    real = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    assert calls and cpu_native._lib is not None
    assert list((build_root / "kernels").glob("rein_cpu_kernels-*.so"))

    monkeypatch.setenv(setting, "0")
    get_settings.cache_clear()
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    assert cpu_native.library() is None and cpu_native.why_unavailable() == f"{setting}=0"
    out = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.1))


def test_no_compiler_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(cpu_native.shutil, "which", lambda name: None)
    q, k, v, tables, lens = make_case([10], 4, 2, 32, 16)
    with caplog.at_level(logging.WARNING, logger="rein.kernels.cpu_native"):
        assert cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.1) is None
        assert cpu_native.paged_decode_attention(q, k, v, tables, lens, 0.1) is None
    assert [r.message for r in caplog.records if "unavailable" in r.message] == [
        "native CPU kernels unavailable, using torch's (no C compiler (cc or gcc) on PATH)"]
    out = kernels.paged_decode_attention(q, k, v, tables, lens, 0.1)
    torch.testing.assert_close(out, reference.paged_decode_attention(q, k, v, tables, lens, 0.1))


# -- prefill attention ---------------------------------------------------------------------

def make_prefill_case(chunks, contexts, num_heads, num_kv_heads, head_dim, block_size, seed=0):
    """A paged cache holding `contexts` tokens per request and a query chunk of `chunks` tokens
    each (the chunk's tokens are the context's last ones)."""
    _, k, v, tables, lens = make_case(contexts, num_heads, num_kv_heads, head_dim, block_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(chunks), num_heads, head_dim, generator=g) * 2
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return query, k, v, tables, cu, lens


def off_prefill_panel(head_dim: int) -> bool:
    """Whether the C prefill kernel declines this head_dim, not a multiple of its panel width
    (32 keys with AVX-512, 16 without: the tiny model's 16-float heads under AVX-512), where
    the engine runs torch's kernel."""
    lib = cpu_native.library()
    assert lib is not None, "the native kernels did not build or load"
    return head_dim % lib.prefill_attention_f32_nr() != 0


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", HEAD_LAYOUTS)
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_matches_reference(num_heads, num_kv_heads, head_dim, block_size, threads, monkeypatch):
    """Whole prompts, chunks after a cached prefix, one-token chunks, and lengths off every
    tile size (12 or 6 query rows, 32 or 16 keys)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    chunks = [1, 5, 37, 13, 70, 1]
    contexts = [1, 5, 60, 13, 300, 33]
    args = make_prefill_case(chunks, contexts, num_heads, num_kv_heads, head_dim, block_size)
    got = cpu_native.paged_prefill_attention(*args, 0.125)
    if off_prefill_panel(head_dim):
        assert got is None, "the kernel declines a head_dim off its panel width (torch's kernel runs)"
        return
    assert got is not None, "the native kernel did not build or load"
    want = reference.paged_prefill_attention(*args, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_prefill_large_scores_and_strided_query(march):
    """Scores far apart (the running maximum jumps between key tiles) and a query that is a
    strided view of the fused projection, as the model passes it. Scores in the hundreds carry
    float32 rounding of ~1e-5 each into exp(); without FMA (the baseline build) the products
    round once more, and the outputs differ from torch's by up to ~7e-5."""
    query, k, v, tables, cu, lens = make_prefill_case([40, 90], [40, 200], 6, 2, 32, 16, seed=7)
    query = query * 40
    wide = torch.cat([query, query], dim=-1)[..., :32]
    got = cpu_native.paged_prefill_attention(wide, k, v, tables, cu, lens, 0.2)
    want = reference.paged_prefill_attention(query, k, v, tables, cu, lens, 0.2)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5 if march == "native" else 1.5e-4, rtol=1e-5)


def test_prefill_dispatch_and_what_it_declines(monkeypatch):
    args = make_prefill_case([10, 20], [10, 50], 4, 2, 32, 16)
    calls = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.testing.assert_close(kernels.paged_prefill_attention(*args, 0.1),
                               reference.paged_prefill_attention(*args, 0.1), atol=2e-5, rtol=1e-5)
    assert bool(calls) == cpu_native.prefill_attention_pays()   # torch's kernel without AVX-512
    query, k, v, tables, cu, lens = make_prefill_case([10], [10], 4, 2, 24, 16)   # head_dim off the panel width
    assert real(query, k, v, tables, cu, lens, 0.1) is None
    assert real(query.bfloat16(), k.bfloat16(), v.bfloat16(), tables, cu, lens, 0.1) is None


# -- element-wise --------------------------------------------------------------------------


def torch_rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm(rows, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 576, generator=g) * 3, torch.randn(576, generator=g)
    torch.testing.assert_close(cpu_native.rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5))
    # a strided 2-D view (every other row) and a 3-D input
    torch.testing.assert_close(cpu_native.rms_norm(x[::2], w, 1e-6), torch_rms_norm(x[::2], w, 1e-6))
    x3 = x.view(rows, 9, 64)
    torch.testing.assert_close(cpu_native.rms_norm(x3, w[:64], 1e-6), torch_rms_norm(x3, w[:64], 1e-6))


def test_add_rms_norm_updates_the_residual():
    g = torch.Generator().manual_seed(1)
    residual, x, w = torch.randn(33, 96, generator=g), torch.randn(33, 96, generator=g), torch.randn(96, generator=g)
    total = residual + x
    out = cpu_native.add_rms_norm(residual, x, w, 1e-5)
    torch.testing.assert_close(residual, total)
    torch.testing.assert_close(out, torch_rms_norm(total, w, 1e-5))


def test_silu_and_mul():
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(50, 2 * 1536, generator=g) * 8   # wide range: exp of large magnitudes
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(cpu_native.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)
    strided = torch.randn(50, 4 * 64, generator=g)[:, :128]    # rows further apart than they are wide
    gate, up = strided.split(64, dim=-1)
    torch.testing.assert_close(cpu_native.silu_and_mul(strided), torch.nn.functional.silu(gate) * up)


def test_rotary_in_place_on_the_fused_projection():
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(21, (9 + 2 * 3) * 64, generator=g)
    qk = qkv[:, :12 * 64].view(21, 12, 64)     # Q and K heads of the fused projection, V left alone
    v_before = qkv[:, 12 * 64:].clone()
    angles = torch.rand(21, 1, 32, generator=g) * 100
    want = apply_rotary(qk.clone(), angles.cos(), angles.sin())
    assert cpu_native.rotary_(qk, angles.cos(), angles.sin())
    torch.testing.assert_close(qk, want)
    assert torch.equal(qkv[:, 12 * 64:], v_before)


def test_element_wise_decline_what_they_do_not_handle():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert cpu_native.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5) is None
    assert cpu_native.silu_and_mul(x) is None
    assert cpu_native.rms_norm(torch.randn(8, 4, 64)[:, ::2], torch.ones(64), 1e-5) is None   # strided 3-D
    assert not cpu_native.rotary_(torch.randn(3, 2, 64).transpose(0, 1), torch.ones(2, 32), torch.ones(2, 32))
