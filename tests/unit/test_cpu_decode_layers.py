"""A decode step's layers in one C call (rein.kernels.cpu_decode_layers): the engine's greedy
tokens and logprobs with it are those of the layer-by-layer forward, for every model family and
weight form it takes; it runs only on steps of single-token decodes and leaves every other
step, and models it does not take, to the modules.

Each case runs the same requests twice, REIN_CPU_FUSED_DECODE on and off: three prompts of
different lengths prefilled in chunks beside running decodes (mixed steps, which take the
modules), then decode steps of three rows and, as requests finish, fewer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import Gemma3TextConfig, LlamaConfig
from unit_support import save_tiny_hf_model

from rein.core.settings import get_settings
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.kernels import cpu_native
from rein.kernels.cpu_decode_layers import DecodeLayers

pytestmark = pytest.mark.skipif(cpu_native.library() is None, reason="needs rein's C kernels")

PROMPTS = [list(range(5, 12)), list(range(100, 150)), [42, 17, 3, 99]]
MAX_TOKENS = 12


def gemma3(tiny_models, out: Path, window: int) -> Path:
    """A random tiny Gemma 3 (five windowed layers to one full) with the tiny llama's tokenizer."""
    source = tiny_models("llama")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, sliding_window=window, max_position_embeddings=512,
                              query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                              num_hidden_layers=6)
    config.architectures = ["Gemma3ForCausalLM"]
    return save_tiny_hf_model(config, source, out, spread_norms=True)


def llama_k_quantable(tiny_models, out: Path) -> Path:
    """A random tiny Llama whose every projection is whole k-quant blocks of 256 (the tiny
    presets' MLPs are not, so their down projections would stay float)."""
    source = tiny_models("llama")
    vocab = json.loads((source / "config.json").read_text())["vocab_size"]
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    config.architectures = ["LlamaForCausalLM"]
    return save_tiny_hf_model(config, source, out, spread_norms=True)


def run(model: Path, fused: bool, monkeypatch, **config) -> tuple[dict, dict, int, LLMEngine]:
    """Greedy tokens and logprobs per request, and how many steps the fused call ran."""
    monkeypatch.setenv("REIN_CPU_FUSED_DECODE", "1" if fused else "0")
    get_settings.cache_clear()
    calls = {"fused": 0}
    original = DecodeLayers.run

    def counted(self, *args):
        ran = original(self, *args)
        calls["fused"] += ran
        return ran

    monkeypatch.setattr(DecodeLayers, "run", counted)
    values = dict(model=str(model), device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=4 << 20,
                  max_num_batched_tokens=16, block_size=4) | config
    engine = LLMEngine(EngineConfig(**values))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    logprobs: dict[str, list[float]] = {str(i): [] for i in range(len(PROMPTS))}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(entry.logprob for entry in out.logprobs or [])
    finally:
        engine.close()
        monkeypatch.undo()
        get_settings.cache_clear()
    return tokens, logprobs, calls["fused"], engine


def assert_same_run(model: Path, monkeypatch, tolerance: float, **config) -> LLMEngine:
    tokens, logprobs, fused_steps, engine = run(model, True, monkeypatch, **config)
    want_tokens, want_logprobs, off_steps, _ = run(model, False, monkeypatch, **config)
    assert off_steps == 0
    # Every request decodes MAX_TOKENS - 1 tokens after its prefill; most of those steps are
    # decode-only (the first prompts' decodes wait beside the long one's chunks).
    assert fused_steps >= MAX_TOKENS // 2, f"the fused call ran on {fused_steps} steps"
    assert tokens == want_tokens
    for key, values in logprobs.items():
        assert values == pytest.approx(want_logprobs[key], abs=tolerance), key
    return engine


@pytest.mark.parametrize(("qtype", "kv"), [("Q4_K", "float16"), ("Q6_K", "float32"), ("Q5_0", "bfloat16"),
                                           ("Q8_0", "float16")])
def test_gguf_llama_decodes_as_the_modules_do(tiny_models, tmp_path, monkeypatch, qtype, kv):
    """GGUF blocks in each form the CPU kernels hold: 4-bit, packed 5/6-bit, 8-bit; each KV type."""
    from rein.fixtures.tiny_gguf import write_gguf

    path = write_gguf(llama_k_quantable(tiny_models, tmp_path / "llama"), tmp_path / f"{qtype}.gguf", qtype)
    # The same kernels on the same floats, in the same order: the same logprobs.
    assert_same_run(path, monkeypatch, 1e-5, kv_cache_dtype=kv)


def test_int8_activations_decode_as_the_modules_do(tiny_models, tmp_path, monkeypatch):
    from rein.fixtures.tiny_gguf import write_gguf

    path = write_gguf(tiny_models("llama", preset="small"), tmp_path / "q4_1.gguf", "Q4_1")
    assert_same_run(path, monkeypatch, 1e-5, quantized_activations="int8", kv_cache_dtype="float16")


@pytest.mark.parametrize(("arch", "quantization"), [("qwen2", "int8"), ("qwen3", "int4-g32"), ("mistral", "int4-g32")])
def test_llama_family_quantized_at_load_decodes_as_the_modules_do(tiny_models, monkeypatch, arch, quantization):
    """Qwen2's q/k/v bias, Qwen3's per-head q/k norms, Mistral; weights quantized at load."""
    assert_same_run(tiny_models(arch), monkeypatch, 1e-5, quantization=quantization)


@pytest.mark.parametrize("window", [8, 400])
def test_gemma3_decodes_as_the_modules_do(tiny_models, tmp_path, monkeypatch, window):
    """Gemma 3: four norms, per-head q/k norms, tanh GELU, the local rope on its windowed layers;
    window 8 (below the requests' lengths) gives those layers storage of their own. The GELU is
    rein's C, the modules' torch's: their floats may differ in the last bits."""
    model = gemma3(tiny_models, tmp_path / "gemma3", window)
    engine = assert_same_run(model, monkeypatch, 1e-4, quantization="int4-g32")
    assert (engine.windows is not None) == (window == 8)


def test_models_it_does_not_take_run_as_modules(tiny_models, monkeypatch):
    """Float weights (oneDNN's matmuls, not the C kernels') and an int8 KV cache: no fused step,
    and the same tokens as with it off."""
    for config in ({}, {"quantization": "int4-g32", "kv_cache_dtype": "int8"}):
        tokens, _, fused_steps, _ = run(tiny_models("llama"), True, monkeypatch, **config)
        want, _, _, _ = run(tiny_models("llama"), False, monkeypatch, **config)
        assert fused_steps == 0
        assert tokens == want
