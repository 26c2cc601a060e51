"""Models with quantized weights in the engine: `--quantization int8 / int4-gN` made at load, and
AWQ / GPTQ 4-bit checkpoints, each against the same model written as a float checkpoint of its
dequantized weights, and on two tensor-parallel ranks. The projections must really be held
quantized (rein.model.architectures.linear), the greedy tokens must be the same, and the logprobs
within float32 rounding of each other.

The models are random-weight tiny ones: llama (GQA, untied head) and qwen2 (q/k/v bias, tied
embeddings). GGUF files' blocks are in tests/unit/test_gguf_blocks.py (each type) and in the
real tier (tests/real/test_quantized_gguf.py: SmolLM2 Q4_1, Gemma 3 Q4_K_M).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_methods import awq_pack, gptq_pack_qweight, gptq_pack_zeros_v1_autogptq

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.model.architectures.linear import Linear
from rein.model.quant.methods import quantize_int4, quantize_int8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGPROB_TOLERANCE = 1e-3
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42, 17, 3]]


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def variant(source: Path, out: Path, tensors: dict[str, torch.Tensor], config_update: dict | None = None) -> Path:
    """A copy of the model folder `source` with its safetensors replaced by `tensors`."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(out / "model.safetensors"))
    if config_update:
        config = json.loads((out / "config.json").read_text())
        config.update(config_update)
        (out / "config.json").write_text(json.dumps(config))
    return out


def checkpoint(model: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def run(model: Path, quantization: str = "auto", **config) -> tuple[LLMEngine, dict[int, list[int]], dict[int, list[float]]]:
    """A fresh engine's greedy tokens and their logprobs for PROMPTS."""
    values = {"max_model_len": 256, "kv_cache_memory": 512 * 1024} | config
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", quantization=quantization, **values))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    logprobs: dict[int, list[float]] = {i: [] for i in range(len(PROMPTS))}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens[int(out.request_id)].extend(out.new_token_ids)
                logprobs[int(out.request_id)].extend(entry.logprob for entry in out.logprobs or [])
    finally:
        engine.close()
    return engine, tokens, logprobs


def quantized_linears(engine: LLMEngine) -> dict[str, str]:
    return {name: module.quantized.source for name, module in engine.runner.model.named_modules()
            if isinstance(module, Linear) and module.quantized is not None}


def assert_same_model(quantized: Path | tuple[Path, str], reference: Path, expect_sources: set[str]) -> float:
    model, method = quantized if isinstance(quantized, tuple) else (quantized, "auto")
    engine, tokens, logprobs = run(model, method)
    held = quantized_linears(engine)
    num_layers = engine.spec.num_layers
    assert len(held) == 4 * num_layers, f"projections held quantized: {sorted(held)}"
    assert set(held.values()) == expect_sources
    _, want_tokens, want_logprobs = run(reference)
    assert tokens == want_tokens
    error = max(abs(a - b) for i in logprobs for a, b in zip(logprobs[i], want_logprobs[i], strict=True))
    assert error < LOGPROB_TOLERANCE
    print(f"{model.name}: max logprob error {error:.2e}")
    return error


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["int8", "int4-g32"])
def test_quantized_at_load_equals_its_dequantized_checkpoint(tiny_models, tmp_path, arch, method):
    source = tiny_models(arch)
    quantize = quantize_int8 if method == "int8" else (lambda w: quantize_int4(w, 32))
    tensors = {name: (quantize(t.float()).dequantize(t.dtype) if is_projection(name) else t)
               for name, t in checkpoint(source).items()}
    reference = variant(source, tmp_path / "reference", tensors)
    assert_same_model((source, method), reference, {"int8"} if method == "int8" else {"int4-g32"})


def affine_4bit(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> q [out, in], zero [out, in/group] (0..15), scales fp16 [in/group, out]."""
    g = w.float().view(w.shape[0], -1, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp_min(1e-6).half()
    zero = (-low / scale.float()).round().clamp(0, 15)
    q = (g / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).round().clamp(0, 15)
    return q.view(w.shape).to(torch.int64), zero.to(torch.int64), scale.t().contiguous()


def dense(q: torch.Tensor, zero: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    return scales.t().float().repeat_interleave(group, 1) * (q - zero.repeat_interleave(group, 1)).float()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_checkpoints_equal_their_dequantized_checkpoint(tiny_models, tmp_path, arch, method):
    group = 32
    source = tiny_models(arch)
    packed, reference = {}, {}
    for name, t in checkpoint(source).items():
        if not is_projection(name):
            packed[name] = reference[name] = t
            continue
        q, zero, scales = affine_4bit(t, group)
        stem = name.removesuffix(".weight")
        if method == "awq":
            packed[stem + ".qweight"], packed[stem + ".qzeros"] = awq_pack(q, zero)
        else:
            zero = zero.clamp_min(1)   # AutoGPTQ's v1 format cannot store a zero of 0
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
    # --quantization none reads the same checkpoint as floats: the same tokens again.
    engine, tokens, _ = run(model, "none")
    assert quantized_linears(engine) == {}
    assert tokens == run(floats)[1]


def test_a_quantized_checkpoint_refuses_quantizing_again(tiny_models, tmp_path):
    source = tiny_models("llama")
    tensors = checkpoint(source)
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
    model = variant(source, tmp_path / "awq", tensors, {"quantization_config": config})
    with pytest.raises(ValueError, match="already quantized .*drop --quantization int8"):
        run(model, "int8")
    # vLLM's names for the checkpoint's own method: auto when they match, refused when not.
    run(model, "awq")
    with pytest.raises(ValueError, match="--quantization gptq names the checkpoint's method, but this checkpoint "
                                         "is AWQ: use --quantization auto"):
        run(model, "gptq")


def test_unknown_quantization_names_the_choices(tiny_models):
    with pytest.raises(ValueError, match="choose one of auto, none, int8, int4"):
        EngineConfig(model=str(tiny_models("llama")), quantization="fp4")


def test_a_group_that_does_not_fit_keeps_the_weight_float(tiny_models, caplog):
    """int4's default group of 128 does not divide the tiny model's 64 columns: those weights
    stay float (said in the log), down_proj's 128 columns are quantized."""
    engine, _, _ = run(tiny_models("llama"), "int4")
    held = quantized_linears(engine)
    assert held and all(name.endswith("down_proj") for name in held)
    assert "stays float32" in caplog.text and "multiple" in caplog.text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tensor_parallel_ranks_hold_their_shard_quantized(tiny_models, arch):
    """Two ranks (gloo, CPU) each hold their rows of q/k/v and gate/up and their columns of o
    and down (whole groups of 32) quantized, and give one rank's tokens."""
    model = tiny_models(arch)
    _, want_tokens, want_logprobs = run(model, "int4-g32")
    sharded, tokens, logprobs = run(model, "int4-g32", kv_cache_memory=256 * 1024, tensor_parallel_size=2)
    assert len(quantized_linears(sharded)) == 4 * sharded.spec.num_layers
    assert tokens == want_tokens
    assert max(abs(a - b) for i in logprobs for a, b in zip(logprobs[i], want_logprobs[i], strict=True)) < 1e-4
