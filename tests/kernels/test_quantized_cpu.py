"""rein's CPU quantized matmul (csrc/quantized_matmul_cpu.c through rein.kernels.quantized)
against the dequantized weight's product, for every weight form GGUF, AWQ/GPTQ and
--quantization produce, in each build a CPU may get: this CPU's (AVX-512 here), AVX2 without
AVX-512 (-march=haswell) and the x86-64 baseline's plain loops. And the CPU's panel layout
(CpuPanels) holds the same weight: its lookups and dequantization give the weight's rows."""

import pytest
import torch
from kernel_builds import use_c_kernels

from rein.core.settings import get_settings
from rein.kernels import cpu_native, quantized
from rein.kernels.packed_bits import pack_rows, unpack_rows
from rein.kernels.quantized import (
    CpuPanels,
    QuantizedWeight,
    quantized_linear,
    reference_linear,
    stack_rows,
)


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("quantized-kernels")


@pytest.fixture(autouse=True, params=["native", "haswell", "x86-64"])
def march(request, build_root, monkeypatch):
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def random_weight(bits, rows, cols, group, offset=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
    else:
        q = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
    groups = cols // group
    scale = torch.rand(rows, groups, generator=gen) * 0.02
    shift = torch.randn(rows, groups, generator=gen) * 0.05 if offset else None
    return QuantizedWeight(bits, q, scale, shift, group, rows, cols)


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = 2e-5 * (1 + want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= bound, f"max error {err:.3g} over {bound:.3g}"


FORMS = [(4, 32, True), (4, 128, True), (4, 256, False), (8, 16, False), (8, 32, True), (8, 256, False)]


@pytest.mark.parametrize("bits,group,offset", FORMS, ids=[f"{b}bit-g{g}-{'off' if o else 'sym'}" for b, g, o in FORMS])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 70])
def test_matmul_equals_the_dequantized_product(bits, group, offset, rows):
    weight = random_weight(bits, 37, 256, group, offset)   # 37: a last panel of 5 rows
    x = torch.randn(rows, 256)
    bias = torch.randn(37)
    assert_close(quantized_linear(x, weight, bias), reference_linear(x, weight, bias))
    assert_close(quantized_linear(x, weight), reference_linear(x, weight))


def test_the_kernel_runs_rather_than_the_fallback(monkeypatch):
    """Every row count takes the C kernel (registers, or an expanded panel), never the
    dequantize-everything reference."""
    monkeypatch.setattr(quantized, "reference_linear", lambda *a: pytest.fail("fell back to the reference"))
    weight = CpuPanels.from_weight(random_weight(4, 64, 256, 32))
    for rows in (1, 9, 40, 300):
        quantized_linear(torch.randn(rows, 256), weight)


def test_the_bound_kernel_follows_the_library(monkeypatch):
    """A weight's kernel call is bound once and reused, bound again for another library (a
    rebuilt or reloaded one); rows of another width are refused, not read past their end."""
    weight = CpuPanels.from_weight(random_weight(4, 37, 256, 32))
    x = torch.randn(1, 256)
    first = quantized_linear(x, weight)
    bound = weight.kernel
    assert bound is not None and bound.lib is cpu_native.library()
    assert torch.equal(quantized_linear(x, weight), first) and weight.kernel is bound
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    assert torch.equal(quantized_linear(x, weight), first)
    assert weight.kernel is not bound and weight.kernel.lib is cpu_native.library()
    assert cpu_native.quantized_matmul(torch.randn(1, 128), weight) is None


def test_batched_input_shapes_and_dtypes():
    weight = random_weight(4, 48, 128, 32)
    x = torch.randn(2, 5, 128)
    assert_close(quantized_linear(x, weight), reference_linear(x, weight))
    half = x.to(torch.bfloat16)
    assert quantized_linear(half, weight).dtype == torch.bfloat16


def test_columns_and_groups_of_any_width():
    """8-bit per-channel scales over 48 columns (an int8 weight of a small model)."""
    weight = random_weight(8, 5, 48, 48)
    x = torch.randn(3, 48)
    assert_close(quantized_linear(x, weight), reference_linear(x, weight))


@pytest.mark.parametrize("bits,offset", [(4, True), (8, False)])
def test_panels_hold_the_same_weight(bits, offset):
    weight = random_weight(bits, 37, 128, 32, offset)
    panels = CpuPanels.from_weight(weight)
    assert panels.shape == weight.shape
    torch.testing.assert_close(panels.dequantize(), weight.dequantize(), rtol=0, atol=0)
    ids = torch.tensor([[0, 36, 17], [16, 15, 3]])
    torch.testing.assert_close(panels.rows_of(ids), weight.rows_of(ids), rtol=0, atol=0)


def test_stacked_mixed_formats_multiply_as_their_parts():
    """A fused q/k/v of a GGUF _M file: 4-bit group 32 with offsets next to 8-bit group 16."""
    parts = [random_weight(4, 20, 256, 32, True, seed=1), random_weight(8, 12, 256, 16, False, seed=2)]
    fused = stack_rows(parts)
    x = torch.randn(4, 256)
    want = torch.cat([reference_linear(x, p) for p in parts], dim=1)
    assert_close(quantized_linear(x, fused), want)


# GGUF's 5- and 6-bit types held packed (rein.kernels.packed_bits): bits, group, block, zero,
# and which of scale_sub / offset / offset_sub they carry.
PACKED_FORMS = {
    "Q5_0": dict(bits=5, group=32, block=32, zero=16, sub=False, offset=False, offset_sub=False),
    "Q5_1": dict(bits=5, group=32, block=32, zero=0, sub=False, offset=True, offset_sub=False),
    "Q5_K": dict(bits=5, group=32, block=256, zero=0, sub=True, offset=True, offset_sub=True),
    "Q6_K": dict(bits=6, group=16, block=256, zero=32, sub=True, offset=False, offset_sub=False),
}


def random_packed(name, rows, cols, seed=0):
    form = PACKED_FORMS[name]
    bits, group, block = form["bits"], form["group"], form["block"]
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 1 << bits, (rows, cols), generator=gen)

    def half(n):
        return ((torch.rand(rows, n, generator=gen) - 0.5) * 0.02).to(torch.float16)

    def sub(n, low):
        return torch.randint(low, 64, (rows, n), dtype=torch.int8, generator=gen)

    return QuantizedWeight(
        bits, pack_rows(ints, bits), half(cols // block), half(cols // block) if form["offset"] else None, group,
        rows, cols, name, zero=form["zero"], block=block,
        scale_sub=sub(cols // group, -64) if form["sub"] else None,
        offset_sub=sub(cols // group, 0) if form["offset_sub"] else None)


@pytest.mark.parametrize("name", sorted(PACKED_FORMS))
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 70])
def test_packed_5_and_6_bit_matmul_equals_the_dequantized_product(name, rows):
    weight = random_packed(name, 37, 512, seed=rows)
    x = torch.randn(rows, 512)
    bias = torch.randn(37)
    assert_close(quantized_linear(x, weight, bias), reference_linear(x, weight, bias))
    assert_close(quantized_linear(x, weight), reference_linear(x, weight))


@pytest.mark.parametrize("name", sorted(PACKED_FORMS))
def test_packed_panels_hold_the_same_weight(name, monkeypatch):
    weight = random_packed(name, 37, 256)
    panels = CpuPanels.from_weight(weight)
    assert panels.nbytes() == weight.padded_rows(48).nbytes()   # the same bytes, the last panel padded
    torch.testing.assert_close(panels.dequantize(), weight.dequantize(), rtol=0, atol=0)
    ids = torch.tensor([[0, 36, 17], [16, 15, 3]])
    torch.testing.assert_close(panels.rows_of(ids), weight.rows_of(ids), rtol=0, atol=0)
    monkeypatch.setattr(quantized, "reference_linear", lambda *a: pytest.fail("fell back to the reference"))
    for rows in (1, 9, 40):   # registers, and an expanded panel: the C kernel either way
        quantized_linear(torch.randn(rows, 256), panels)


def test_packed_rows_round_trip():
    for bits in (5, 6):
        ints = torch.randint(0, 1 << bits, (7, 96))
        assert torch.equal(unpack_rows(pack_rows(ints, bits), bits, 7, 96), ints)
        assert pack_rows(ints, bits).shape == (7, 96 * bits // 8)


def test_packed_stacks_and_shards():
    """Same-form parts stack packed; Q5_K beside Q6_K (a GGUF _M file's q/k/v) widens to 8 bits;
    a column shard on block boundaries stays packed."""
    a, b = random_packed("Q5_K", 20, 512, seed=1), random_packed("Q5_K", 12, 512, seed=2)
    fused = stack_rows([a, b])
    assert fused.bits == 5 and fused.rows == 32
    x = torch.randn(3, 512)
    assert_close(quantized_linear(x, fused), torch.cat([reference_linear(x, a), reference_linear(x, b)], dim=1))
    mixed = stack_rows([a, random_packed("Q6_K", 12, 512, seed=3)])
    assert mixed.bits == 8
    torch.testing.assert_close(mixed.dequantize()[:20], a.dequantize(), rtol=0, atol=0)
    half = a.narrow_cols(256, 256)
    assert half.bits == 5
    torch.testing.assert_close(half.dequantize(), a.dequantize()[:, 256:], rtol=0, atol=0)
    assert a.narrow_cols(32, 224) is None   # splits a 256-column scale block
