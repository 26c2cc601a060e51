"""llama.cpp's mixture-of-experts GGUF files in the engine: Qwen3-MoE, Qwen2-MoE (shared expert)
and Mixtral (llama architecture with experts), written from tiny random-weight models by
rein.fixtures.tiny_gguf the way llama.cpp's converter writes them (stacked ffn_*_exps, router
ffn_gate_inp, ffn_*_shexp), quantized to Q8_0 / Q4_0 / Q4_1 by gguf's own quantizer, and
experts in Q4_K (written by tiny_gguf.quantize_q4_k: 256-column blocks, on a wider model).

Each file must load into rein's native MoE model with its experts held quantized (not
dequantized: the test looks at what the blocks hold), and give the greedy tokens and logprobs of

* the same file dequantized (`--quantization none`: rein's float path over the same weights), and
* transformers running the float model the file holds (the tiny model with every tensor rounded
  through gguf's quantize/dequantize), an independent reference for the name mapping, the
  config read from the metadata and the experts' routing; and, where its GGUF loader reads the
  file right (Qwen3-MoE with experts of its config's default width), transformers loading the
  GGUF file itself.

Tolerance: everything runs in float32 and both sides multiply the same dequantized values;
only the order of the additions differs (rein's C kernel per expert, oneDNN, transformers'
matmuls), which moves logprobs by about 1e-6 here. 1e-3 is test_quantized_models' bound,
far below the quantization error itself (Q4_0 moves logprobs by ~1e-1 against the float model),
so a wrongly mapped or mis-ordered tensor cannot pass.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.kernels.quantized import CpuPanels
from rein.kernels.quantized_experts import QuantizedExperts
from rein.model.architectures.moe import SparseMoeBlock
from rein.model.quant.checkpoint import estimated_weight_bytes, resident_bytes

gguf = pytest.importorskip("gguf")

from rein.fixtures.tiny_gguf import rounded_checkpoint, write_gguf  # noqa: E402

LOGPROB_TOLERANCE = 1e-3
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42, 17, 3]]
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def gguf_cache(tmp_path, monkeypatch):
    """A fresh cache for the GGUF views (config + tokenizer read from each file)."""
    from rein.core.settings import get_settings

    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@pytest.fixture(scope="module")
def moe_models(tiny_models, tmp_path_factory):
    """arch -> a tiny HF model directory llama.cpp's MoE layout can hold: the fixture's
    Qwen3-MoE keeps a dense last layer (mlp_only_layers), which llama.cpp's qwen3moe has no
    tensors for, so that one is rebuilt sparse throughout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    models = {"qwen2_moe": tiny_models("qwen2_moe"), "mixtral": tiny_models("mixtral")}
    source = tiny_models("qwen3_moe")
    out = tmp_path_factory.mktemp("qwen3_moe-sparse")
    config = AutoConfig.from_pretrained(str(source))
    config.mlp_only_layers = []
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, out / name)
    models["qwen3_moe"] = out
    return models


def run(model: Path, quantization: str = "auto", **config):
    """A fresh engine's greedy tokens and logprobs for PROMPTS, and the engine (closed)."""
    values = {"max_model_len": 256, "kv_cache_memory": 512 * 1024} | config
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", quantization=quantization, **values))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    tokens = {i: [] for i in range(len(PROMPTS))}
    logprobs = {i: [] for i in range(len(PROMPTS))}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens[int(out.request_id)].extend(out.new_token_ids)
                logprobs[int(out.request_id)].extend(entry.logprob for entry in out.logprobs or [])
    finally:
        engine.close()
    return engine, tokens, logprobs


def sparse_blocks(engine) -> list[SparseMoeBlock]:
    return [m for m in engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]


def max_error(a: dict, b: dict) -> float:
    return max(abs(x - y) for i in a for x, y in zip(a[i], b[i], strict=True))


def hf_reference(model_dir: Path, gguf_file: str | None = None) -> tuple[dict, dict]:
    """transformers' greedy tokens and their logprobs for PROMPTS (float32, one argmax at a
    time), from the float model in `model_dir` or from its GGUF file `gguf_file` there."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **extra).eval()
    tokens, logprobs = {}, {}
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ids, lps = list(prompt), []
            for _ in range(MAX_TOKENS):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                token = int(logits.argmax())
                lps.append(float(torch.log_softmax(logits, -1)[token]))
                ids.append(token)
            tokens[i], logprobs[i] = ids[len(prompt):], lps
    return tokens, logprobs


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_a_moe_gguf_runs_with_its_experts_quantized(moe_models, tmp_path, caplog, arch, qtype):
    path = write_gguf(moe_models[arch], tmp_path / f"{arch}-{qtype}.gguf", qtype)
    with caplog.at_level(logging.INFO, logger="rein.model.loader"):
        engine, tokens, logprobs = run(path)
    spec = engine.spec
    assert spec.family == arch and spec.num_experts == 8 and all(spec.sparse_layers)
    assert spec.moe_intermediate_size == (128 if arch == "mixtral" else 32)
    assert spec.shared_expert_intermediate_size == (96 if arch == "qwen2_moe" else 0)

    # Held quantized: every sparse block's experts are the C kernel's integer panels of the
    # file's type, and the float expert tensors are empty.
    blocks = sparse_blocks(engine)
    assert len(blocks) == spec.num_layers
    for block in blocks:
        for experts in (block.quantized_gate_up, block.quantized_down):
            assert isinstance(experts, QuantizedExperts) and experts.source == qtype
            assert len(experts.panels) == 8 and all(isinstance(p, CpuPanels) for p in experts.panels)
            assert experts.panels[0].q.dtype == (torch.int8 if qtype == "Q8_0" else torch.uint8)
        assert block.gate_up_proj.numel() == 0 and block.down_proj.numel() == 0
        assert block.quantized_gate_up.shape == (8, 2 * spec.moe_intermediate_size, spec.hidden_size)
    assert f"MoE experts kept quantized: {qtype} x{3 * spec.num_layers}" in caplog.text
    # `rein estimate` counts the stacked experts at their quantized size too (within the
    # buffers and rounding it does not model).
    estimate, _ = estimated_weight_bytes(spec, engine.model_dir, 4)
    resident = resident_bytes(engine.runner.model)
    assert abs(estimate - resident) < 0.1 * resident, (estimate, resident)

    _, want_tokens, want_logprobs = run(path, "none")    # the same file, dequantized
    assert tokens == want_tokens
    assert max_error(logprobs, want_logprobs) < LOGPROB_TOLERANCE

    hf_tokens, hf_logprobs = hf_reference(rounded_checkpoint(moe_models[arch], tmp_path / "rounded", qtype))
    assert tokens == hf_tokens
    error = max_error(logprobs, hf_logprobs)
    assert error < LOGPROB_TOLERANCE
    print(f"{arch} {qtype}: max logprob error against transformers {error:.2e}")


def test_the_rounding_is_what_the_reference_tests(moe_models, tmp_path):
    """The reference must differ from the unquantized model, or the comparison above would not
    show that the file's blocks are what rein multiplies."""
    _, float_tokens, float_logprobs = run(moe_models["qwen2_moe"])
    path = write_gguf(moe_models["qwen2_moe"], tmp_path / "q4.gguf", "Q4_0")
    _, tokens, logprobs = run(path)
    assert tokens != float_tokens or max_error(logprobs, float_logprobs) > 10 * LOGPROB_TOLERANCE


def test_experts_of_mixed_types_and_the_memory_they_hold(moe_models, tmp_path):
    """Experts in Q4_1 beside Q8_0 projections (a "_M" file mixes types); the quantized experts
    hold a fraction of their float32 bytes (Q4_1: 4 bits + two float32 per 32 = 6 bits a weight)."""
    path = write_gguf(moe_models["mixtral"], tmp_path / "mixed.gguf", "Q8_0", expert_qtype="Q4_1")
    engine, tokens, logprobs = run(path)
    _, want_tokens, want_logprobs = run(path, "none")
    assert tokens == want_tokens and max_error(logprobs, want_logprobs) < LOGPROB_TOLERANCE
    blocks = sparse_blocks(engine)
    held = sum(b.quantized_gate_up.nbytes() + b.quantized_down.nbytes() for b in blocks)
    dense = sum(4 * (torch.Size(b.quantized_gate_up.shape).numel() + torch.Size(b.quantized_down.shape).numel())
                for b in blocks)
    assert {b.quantized_gate_up.source for b in blocks} == {"Q4_1"}
    assert held == dense * 6 // 32


def test_the_view_reads_the_experts_from_the_metadata(moe_models, tmp_path):
    """transformers' GGUF config leaves Qwen2-MoE's expert widths at its class defaults and
    reads Mixtral as a dense Llama; the view corrects both from the metadata."""
    from rein.model.files import resolve_model

    for arch, want in (("qwen2_moe", {"model_type": "qwen2_moe", "num_experts": 8, "moe_intermediate_size": 32,
                                      "shared_expert_intermediate_size": 96, "num_experts_per_tok": 2}),
                       ("mixtral", {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
                                    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 128})):
        files = resolve_model(str(write_gguf(moe_models[arch], tmp_path / f"{arch}.gguf", "Q8_0")))
        config = json.loads((files.directory / "config.json").read_text())
        assert {key: config.get(key) for key in want} == want


def test_a_sharded_read_of_stacked_experts_stays_quantized(moe_models, tmp_path):
    """A tensor-parallel rank's slice of the experts' intermediate dimension (rows of gate/up,
    columns of down) comes quantized and equals the same slice of the dequantized tensor."""
    from rein.model.architectures.weights import Shard
    from rein.model.files import resolve_model
    from rein.model.loader import gguf_tensors
    from rein.model.quant.checkpoint import LoadReport

    # Mixtral's experts are 128 wide: halves of whole Q8_0 blocks (a cut through a block of
    # down's columns would be dequantized instead).
    path = write_gguf(moe_models["mixtral"], tmp_path / "q8.gguf", "Q8_0")
    files = resolve_model(str(path))
    report = LoadReport()
    with gguf_tensors(path, files.directory, torch.float32, report=report) as get:
        for name, dim in (("model.layers.1.block_sparse_moe.experts.w1.weight", 1),
                          ("model.layers.1.block_sparse_moe.experts.w2.weight", 2)):
            whole = get(name)
            assert whole.shape[0] == 8
            for rank in range(2):
                part = get(name, Shard(dim, rank, 2), True)
                assert isinstance(part, QuantizedExperts)
                want = whole[Shard(dim, rank, 2).slices(whole.shape, name)]
                assert torch.equal(part.dequantize(), want)
    assert report.experts["Q8_0"] == 4 and not report.dequantized


def test_a_cut_through_blocks_dequantizes_and_says_so(moe_models, tmp_path):
    """Qwen2-MoE's down experts are 32 columns wide, one Q8_0 block: half of them is no whole
    block, so that read comes dequantized (and counted so), still the right values."""
    from rein.model.architectures.weights import Shard
    from rein.model.files import resolve_model
    from rein.model.loader import gguf_tensors
    from rein.model.quant.checkpoint import LoadReport

    path = write_gguf(moe_models["qwen2_moe"], tmp_path / "q8.gguf", "Q8_0")
    report = LoadReport()
    name = "model.layers.0.mlp.experts.down_proj.weight"
    with gguf_tensors(path, resolve_model(str(path)).directory, torch.float32, report=report) as get:
        whole = get(name)
        part = get(name, Shard(2, 1, 2), True)
    assert isinstance(part, torch.Tensor) and torch.equal(part, whole[:, :, 16:])
    assert report.dequantized["Q8_0"] == 1 and not report.experts


def test_q4_k_experts(moe_models, tmp_path):
    """Q4_K experts (the type of most MoE GGUF files, e.g. Qwen3-30B-A3B Q4_K_M), other matrices
    Q8_0: a Qwen3-MoE 256 wide with experts 256 wide, so every expert row is whole 256-blocks."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = tmp_path / "qwen3_moe-256"
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=512, moe_intermediate_size=256,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                            initializer_range=0.1, tie_word_embeddings=False, use_sliding_window=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moe_models["qwen3_moe"] / name, out / name)
    path = write_gguf(out, tmp_path / "q4k.gguf", "Q8_0", expert_qtype="Q4_K")
    engine, tokens, logprobs = run(path)
    assert len({t for answer in tokens.values() for t in answer}) > 8   # not one token repeated
    assert {b.quantized_gate_up.source for b in sparse_blocks(engine)} == {"Q4_K"}
    assert {b.quantized_down.source for b in sparse_blocks(engine)} == {"Q4_K"}
    _, want_tokens, want_logprobs = run(path, "none")
    assert tokens == want_tokens and max_error(logprobs, want_logprobs) < LOGPROB_TOLERANCE
    hf_tokens, hf_logprobs = hf_reference(rounded_checkpoint(out, tmp_path / "rounded", "Q8_0", "Q4_K"))
    assert tokens == hf_tokens and max_error(logprobs, hf_logprobs) < LOGPROB_TOLERANCE


def test_an_older_mixtral_file_with_one_tensor_per_expert(moe_models, tmp_path, caplog):
    """Mixtral GGUFs converted before 2024 hold `blk.N.ffn_gate.E.weight` per expert: the same
    model as the stacked file, the experts again kept quantized."""
    stacked = write_gguf(moe_models["mixtral"], tmp_path / "stacked.gguf", "Q4_0")
    legacy = write_gguf(moe_models["mixtral"], tmp_path / "legacy.gguf", "Q4_0", stacked_experts=False)
    index = json.loads((view_dir(legacy) / "gguf_tensors.json").read_text())["tensors"]
    assert "blk.1.ffn_down.7.weight" in index and not any("_exps" in name for name in index)
    engine, tokens, logprobs = run(legacy)
    assert {b.quantized_gate_up.source for b in sparse_blocks(engine)} == {"Q4_0"}
    _, want_tokens, want_logprobs = run(stacked)
    assert tokens == want_tokens and max_error(logprobs, want_logprobs) < 1e-5


def view_dir(path: Path) -> Path:
    from rein.model.files import resolve_model

    return resolve_model(str(path)).directory


def test_two_tensor_parallel_ranks_on_a_moe_gguf(moe_models, tmp_path):
    """Two ranks (gloo, CPU) each read their slice of every stacked expert from the file, kept
    quantized (Mixtral's 128-wide experts halve on whole Q8_0 blocks), and give one rank's tokens."""
    path = write_gguf(moe_models["mixtral"], tmp_path / "q8.gguf", "Q8_0")
    _, want_tokens, want_logprobs = run(path)
    engine, tokens, logprobs = run(path, kv_cache_memory=256 * 1024, tensor_parallel_size=2)
    block = sparse_blocks(engine)[0]
    assert block.quantized_gate_up.shape == (8, 128, 64) and block.quantized_down.shape == (8, 64, 64)
    assert block.quantized_gate_up.source == "Q8_0"
    assert tokens == want_tokens and max_error(logprobs, want_logprobs) < 1e-4


def test_against_transformers_reading_the_same_gguf(moe_models, tmp_path):
    """transformers' own GGUF loader (dequantizing; Qwen3-MoE's stacked experts through its
    Qwen2MoeTensorProcessor) as the reference. Its config mapping leaves the experts' width at
    Qwen3MoeConfig's default (768), so the model here has 768-wide experts."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    out = tmp_path / "qwen3_moe-768"
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=128, moe_intermediate_size=768,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
                            initializer_range=0.1, tie_word_embeddings=False, use_sliding_window=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moe_models["qwen3_moe"] / name, out / name)
    path = write_gguf(out, out / "model-q8_0.gguf", "Q8_0")
    engine, tokens, logprobs = run(path)
    assert {b.quantized_down.source for b in sparse_blocks(engine)} == {"Q8_0"}
    hf_tokens, hf_logprobs = hf_reference(out, path.name)
    assert tokens == hf_tokens and max_error(logprobs, hf_logprobs) < LOGPROB_TOLERANCE


def test_5_bit_experts_are_held_packed(moe_models, tmp_path):
    """Q5_1 experts (rein.kernels.packed_bits: a nibble plane, a bit plane, the file's float16
    scales) run per expert through the C kernel and give the file dequantized's tokens."""
    path = write_gguf(moe_models["qwen3_moe"], tmp_path / "q5.gguf", "Q8_0", expert_qtype="Q5_1")
    engine, tokens, logprobs = run(path)
    blocks = sparse_blocks(engine)
    for block in blocks:
        for experts in (block.quantized_gate_up, block.quantized_down):
            assert experts.source == "Q5_1" and {p.bits for p in experts.panels} == {5}
    _, want_tokens, want_logprobs = run(path, "none")
    assert tokens == want_tokens and max_error(logprobs, want_logprobs) < LOGPROB_TOLERANCE
