"""The int8-activation quantized matmul (csrc/quantized_matmul_int8act.c through
rein.kernels.quantized's Int8Panels): in each build a CPU may get -- this CPU's (AVX-512 VNNI
here), AVX2 without AVX-512 (-march=haswell: pmaddubsw) and the x86-64 baseline's plain loops --
it equals torch's product of the same int8-quantized activations with the dequantized weight,
for every weight form rein holds; its error against the float32 product stays within what
rounding the activations to 8 bits allows; and the layout holds the same weight."""

import pytest
import torch
from kernel_builds import use_c_kernels
from test_quantized_cpu import PACKED_FORMS, random_packed, random_weight

from rein.core.settings import get_settings
from rein.kernels import quantized
from rein.kernels.quantized import (
    ACT_BLOCK,
    CpuPanels,
    Int8Panels,
    int8_activation_reference,
    quantize_activations,
    quantized_linear,
    reference_linear,
    stack_rows,
    with_int8_activations,
)


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("int8act-kernels")


@pytest.fixture(autouse=True, params=["native", "haswell", "x86-64"])
def march(request, build_root, monkeypatch):
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    bound = 2e-5 * (1 + want.abs().max().item())
    err = (got - want).abs().max().item()
    assert err <= bound, f"max error {err:.3g} over {bound:.3g}"


FORMS = [(4, 32, True), (4, 128, False), (8, 16, True), (8, 32, False), (8, 256, True)]
FORM_IDS = [f"{b}bit-g{g}-{'off' if o else 'sym'}" for b, g, o in FORMS]


@pytest.mark.parametrize("bits,group,offset", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("rows", [1, 3, 13, 40])
def test_kernel_equals_torch_on_the_same_int8_activations(bits, group, offset, rows):
    weight = random_weight(bits, 37, 512, group, offset, seed=rows)   # 37: a last panel of 5 rows
    panels = Int8Panels.from_weight(weight)
    x = torch.randn(rows, 512) * torch.linspace(0.1, 3.0, 512)   # blocks of different ranges
    bias = torch.randn(37)
    assert_close(quantized_linear(x, panels, bias), int8_activation_reference(x, weight, bias))
    assert_close(quantized_linear(x, panels), int8_activation_reference(x, weight))


@pytest.mark.parametrize("name", sorted(PACKED_FORMS))
@pytest.mark.parametrize("rows", [1, 13, 40])
def test_packed_5_and_6_bit_forms(name, rows):
    weight = random_packed(name, 37, 512, seed=rows)
    panels = Int8Panels.from_weight(CpuPanels.from_weight(weight))   # as the engine has it: from panels
    x = torch.randn(rows, 512)
    bias = torch.randn(37)
    assert_close(quantized_linear(x, panels, bias), int8_activation_reference(x, weight, bias))


def test_mixed_formats_stacked():
    """A fused q/k/v of a GGUF _M file (widened to 8 bits, group 16 with offsets)."""
    parts = [random_weight(4, 20, 256, 32, True, seed=1), random_weight(8, 12, 256, 16, False, seed=2)]
    fused = stack_rows(parts)
    x = torch.randn(6, 256)
    assert_close(quantized_linear(x, Int8Panels.from_weight(fused)), int8_activation_reference(x, fused))


@pytest.mark.parametrize("bits,group,offset", FORMS, ids=FORM_IDS)
def test_error_against_the_float32_product_is_the_activation_rounding(bits, group, offset):
    """Each activation moves by at most half its block's step (amax / 127 / 2), so each output
    by at most sum_k |w[n, k]| times that: the bound, computed, and nothing more."""
    weight = random_weight(bits, 64, 512, group, offset, seed=3)
    x = torch.randn(24, 512) * torch.linspace(0.1, 3.0, 512)
    got = quantized_linear(x, Int8Panels.from_weight(weight))
    want = reference_linear(x, weight)
    block = min(ACT_BLOCK, group)
    _, step = quantize_activations(x, block)
    half_step = (step / 2).repeat_interleave(block, dim=1)
    bound = half_step @ weight.dequantize().abs().T * 1.001 + 1e-4
    err = (got - want).abs()
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max():.3g}"
    # and it is the rounding's size, not far below (a kernel that skipped quantizing would be exact)
    assert err.max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("name", ["4bit", "8bit", *sorted(PACKED_FORMS)])
def test_layout_holds_the_same_weight(name, monkeypatch):
    weight = random_weight(int(name[0]), 37, 256, 32, True) if name.endswith("bit") else random_packed(name, 37, 256)
    panels = Int8Panels.from_weight(weight)
    # The zero point is folded into the offset (o - zero * s): float32 rounding of that sum only.
    torch.testing.assert_close(panels.dequantize(), weight.dequantize(), rtol=1e-6, atol=1e-6)
    ids = torch.tensor([[0, 36, 17], [16, 15, 3]])
    torch.testing.assert_close(panels.rows_of(ids), weight.rows_of(ids), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(quantized, "reference_linear", lambda *a: pytest.fail("fell back to the reference"))
    for rows in (1, 12, 40):
        quantized_linear(torch.randn(rows, 256), panels)


def test_activation_quantization():
    x = torch.zeros(2, 64)
    x[0, :32] = torch.arange(-16, 16) / 4.0   # amax 4: a step of 4/127
    q, d = quantize_activations(x, 32)
    assert d[0, 0] == torch.tensor(4.0) / 127 and d[0, 1] == 0 and d[1].eq(0).all()   # zero blocks: scale 0
    assert q[0, 0] == -127 and q[1].eq(0).all() and not q.float().isnan().any()
    assert (q[0, :32].float() * d[0, 0] - x[0, :32]).abs().max() <= d[0, 0] / 2


def test_with_int8_activations_repacks_the_modules_panels():
    class Holder(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.quantized = weight

    model = torch.nn.Sequential(Holder(CpuPanels.from_weight(random_weight(4, 32, 128, 32))), Holder(None),
                                Holder(CpuPanels.from_weight(random_packed("Q6_K", 16, 256))))
    assert with_int8_activations(model) == 2
    assert isinstance(model[0].quantized, Int8Panels) and model[1].quantized is None
    assert isinstance(model[2].quantized, Int8Panels) and model[2].quantized.act_block == 16
