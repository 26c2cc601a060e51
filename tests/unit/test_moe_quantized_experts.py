"""MoE experts held quantized outside GGUF files: the per-expert grouped matmuls on the CPU
(rein.kernels.quantized_experts) against the float grouped path, and tiny Qwen2-MoE checkpoints
whose experts come quantized -- AWQ / GPTQ 4-bit, --quantization int8 made at load -- against
the same model saved as floats of the dequantized weights (test_quantized_models' method:
same greedy tokens, logprobs within float32 rounding). GGUF files: test_moe_gguf.py."""

from __future__ import annotations

import pytest
import torch
from test_quant_methods import awq_pack, gptq_pack_qweight, gptq_pack_zeros_v1_autogptq
from test_quantized_models import (
    affine_4bit,
    assert_same_model,
    checkpoint,
    dense,
    is_projection,
    run,
    variant,
)

from rein.kernels.quantized import CpuPanels
from rein.kernels.quantized_experts import QuantizedExperts, grouped_quantized_experts
from rein.model.architectures.moe import SparseMoeBlock, grouped_experts, route, silu_and_mul
from rein.model.quant.methods import quantize_int4, quantize_int8


@pytest.mark.parametrize("form", ["int8", "int4-g32"])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 4, 2), (13, 8, 2), (20, 6, 3)])
def test_grouped_quantized_experts_equal_the_float_path_on_their_values(form, tokens, experts, top_k):
    gen = torch.Generator().manual_seed(tokens)
    quantize = quantize_int8 if form == "int8" else (lambda w: quantize_int4(w, 32))

    def stacked(rows, cols):
        return QuantizedExperts.of([quantize(torch.randn(rows, cols, generator=gen) * 0.2) for _ in range(experts)])

    gate_up = QuantizedExperts.gate_up(stacked(32, 64), stacked(32, 64))
    down = stacked(64, 32)
    x = torch.randn(tokens, 64, generator=gen)
    weights, ids = route(torch.randn(tokens, experts, generator=gen), top_k, renormalize=False)
    want = grouped_experts(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    for held in ((gate_up, down), (gate_up.to("cpu"), down.to("cpu"))):   # stacked, then C-kernel panels
        got = grouped_quantized_experts(x, *held, weights, ids, silu_and_mul)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(isinstance(p, CpuPanels) for p in gate_up.to("cpu").panels)


def held_experts(engine) -> set[str]:
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    sources = set()
    for block in blocks:
        assert block.quantized_gate_up is not None and block.gate_up_proj.numel() == 0
        sources |= {block.quantized_gate_up.source, block.quantized_down.source}
    return sources


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_moe_checkpoints_keep_their_experts_quantized(tiny_models, tmp_path, method):
    group = 32
    source = tiny_models("qwen2_moe")
    packed, reference = {}, {}
    for name, t in checkpoint(source).items():
        if not is_projection(name):   # the routed experts' and the shared expert's projections are
            packed[name] = reference[name] = t
            continue
        q, zero, scales = affine_4bit(t, group)
        stem = name.removesuffix(".weight")
        if method == "awq":
            packed[stem + ".qweight"], packed[stem + ".qzeros"] = awq_pack(q, zero)
        else:
            zero = zero.clamp_min(1)
            packed[stem + ".qweight"] = gptq_pack_qweight(q)
            packed[stem + ".qzeros"] = gptq_pack_zeros_v1_autogptq(zero)
            packed[stem + ".g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // group
        packed[stem + ".scales"] = scales
        reference[name] = dense(q, zero, scales, group).to(t.dtype)
    config = {"quant_method": method, "bits": 4, "group_size": group}
    config.update({"zero_point": True, "version": "gemm"} if method == "awq" else {"desc_act": False, "sym": False})
    model = variant(source, tmp_path / method, packed, {"quantization_config": config})
    floats = variant(source, tmp_path / "reference", reference)
    assert_same_model(model, floats, {method})
    assert held_experts(run(model)[0]) == {method}


def test_int8_at_load_quantizes_the_experts(tiny_models, tmp_path):
    source = tiny_models("qwen2_moe")
    tensors = {name: (quantize_int8(t.float()).dequantize(t.dtype) if is_projection(name) else t)
               for name, t in checkpoint(source).items()}
    reference = variant(source, tmp_path / "reference", tensors)
    assert_same_model((source, "int8"), reference, {"int8"})
    assert held_experts(run(source, "int8")[0]) == {"int8"}


def test_experts_a_group_does_not_fit_stay_float(tiny_models, caplog):
    """int4's default group of 128 fits none of the tiny experts (64 and 32 columns): they stay
    float, said in the log, and the model runs as before."""
    engine, tokens, _ = run(tiny_models("qwen2_moe"), "int4")
    blocks = [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert all(b.quantized_gate_up is None and b.gate_up_proj.numel() for b in blocks)
    assert "stays float32" in caplog.text and all(len(t) == 16 for t in tokens.values())


def test_tensor_parallel_ranks_hold_their_slice_of_the_experts_quantized(tiny_models):
    """Two ranks (gloo, CPU) each hold every expert's rows of gate/up and columns of down (64 of
    Mixtral's 128: whole groups of 32) quantized, and give one rank's tokens."""
    model = tiny_models("mixtral")
    _, want_tokens, want_logprobs = run(model, "int4-g32")
    sharded, tokens, logprobs = run(model, "int4-g32", kv_cache_memory=256 * 1024, tensor_parallel_size=2)
    assert held_experts(sharded) == {"int4-g32"}
    block = next(m for m in sharded.runner.model.modules() if isinstance(m, SparseMoeBlock))
    assert block.quantized_gate_up.shape == (8, 128, 64) and block.quantized_down.shape == (8, 64, 64)
    assert tokens == want_tokens
    assert max(abs(a - b) for i in logprobs for a, b in zip(logprobs[i], want_logprobs[i], strict=True)) < 1e-4
