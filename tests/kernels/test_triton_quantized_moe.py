"""The Triton fused MoE over quantized experts (rein.kernels.triton_quantized_moe) against the
float grouped path on the same experts dequantized (rein.model.architectures.moe.grouped_experts).
Without a GPU it runs under the Triton interpreter on CPU tensors (TRITON_INTERPRET set before
the kernels are defined), tiny shapes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")

from rein.kernels import triton_quantized_moe  # noqa: E402
from rein.kernels.quantized import QuantizedWeight  # noqa: E402
from rein.kernels.quantized_experts import QuantizedExperts, triton_quantized_moe_fits  # noqa: E402
from rein.model.architectures.moe import grouped_experts, route  # noqa: E402
from rein.model.quant.gguf_blocks import repack  # noqa: E402
from rein.model.quant.methods import quantize_int4  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def gguf_weight(w: torch.Tensor, kind: str) -> QuantizedWeight:
    """w quantized by gguf's own quantizer and repacked, as the loader does."""
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w.numpy().astype(np.float32), qtype)
    return repack(raw, kind, w.shape[0], w.shape[1])


def group16_weight(w: torch.Tensor) -> QuantizedWeight:
    """8-bit integers in groups of 16 (Q6_K's form), symmetric."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // 16, 16)
    scale = groups.abs().amax(-1).clamp_min(1e-6) / 31
    q = torch.round(groups / scale.unsqueeze(-1)).clamp(-32, 31).to(torch.int8).reshape(rows, cols)
    return QuantizedWeight(8, q, scale.contiguous(), None, 16, rows, cols, "Q6_K")


FORMS = {
    "Q8_0": lambda w: gguf_weight(w, "Q8_0"),       # 8-bit, group 32, no offset
    "Q4_0": lambda w: gguf_weight(w, "Q4_0"),       # 4-bit, group 32, offset
    "Q4_1": lambda w: gguf_weight(w, "Q4_1"),
    "int4-g64": lambda w: quantize_int4(w, min(64, w.shape[1])),   # 4-bit, a group the 64-column tile divides
    "group16": group16_weight,                      # 8-bit, scales gathered per column
}


def experts(kind: str, num: int, rows: int, cols: int, gen: torch.Generator) -> QuantizedExperts:
    return QuantizedExperts.of([FORMS[kind](torch.randn(rows, cols, generator=gen) / cols**0.5) for _ in range(num)])


def case(kind, tokens, num_experts, top_k, hidden=64, inter=32, seed=0, down_kind=None):
    gen = torch.Generator().manual_seed(seed)
    gate = experts(kind, num_experts, inter, hidden, gen)
    up = experts(kind, num_experts, inter, hidden, gen)
    gate_up = QuantizedExperts.gate_up(gate, up)
    down = experts(down_kind or kind, num_experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen), top_k, renormalize=True)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize("kind", sorted(FORMS))
@pytest.mark.parametrize("tokens, num_experts, top_k", [(1, 4, 2), (9, 4, 2), (40, 4, 2)])
def test_fused_quantized_experts_equal_the_dequantized_grouped_path(kind, tokens, num_experts, top_k):
    x, gate_up, down, weights, ids = case(kind, tokens, num_experts, top_k)
    assert triton_quantized_moe_fits(gate_up, down)
    want = grouped_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    on = dict(device=DEVICE)
    got = triton_quantized_moe.fused_quantized_experts(
        x.to(**on), gate_up.to(DEVICE) if DEVICE != "cpu" else gate_up, down.to(DEVICE) if DEVICE != "cpu" else down,
        weights.to(**on), ids.to(**on))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_mixed_forms_and_an_idle_expert():
    """gate/up in Q4_0, down in Q8_0 (as a Q4_K_M file mixes types); one expert gets no token."""
    x, gate_up, down, weights, ids = case("Q4_0", 7, 5, 2, down_kind="Q8_0")
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(3))
    logits[:, 1] = -1e9
    weights, ids = route(logits, 2, renormalize=False)
    assert not (ids == 1).any()
    want = grouped_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    got = triton_quantized_moe.fused_quantized_experts(x.to(DEVICE), gate_up, down, weights.to(DEVICE), ids.to(DEVICE))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def test_half_precision_activations():
    x, gate_up, down, weights, ids = case("Q4_0", 6, 4, 2)
    want = grouped_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    got = triton_quantized_moe.fused_quantized_experts(x.half().to(DEVICE), gate_up, down, weights.to(DEVICE),
                                                       ids.to(DEVICE))
    torch.testing.assert_close(got.float().cpu(), want, atol=2e-2, rtol=2e-2)


def test_shapes_that_do_not_fit_are_refused():
    x, gate_up, down, weights, ids = case("Q8_0", 3, 4, 2)
    with pytest.raises(ValueError, match="hidden size"):
        triton_quantized_moe.fused_quantized_experts(x[:, :32], gate_up, down, weights, ids)
