"""The Transformers backend (rein.model.architectures.transformers_backend): architectures rein has no
native code for run their own transformers modeling code inside rein's engine.

Tiny random models built with transformers' config classes (no hub) and saved into a temp
dir with the tiny llama's tokenizer: rein's greedy tokens equal HF generate() for a batch of
mixed-length prompts joining at different steps, on a KV pool small enough to preempt, with
prefix caching on (prompts share a prefix) and a small step budget (chunked prefill). Also:
the tiny llama through `--model-impl transformers` equals rein's native code, the tensor-by-
tensor loading path (GGUF's) equals transformers' own, and what cannot run is refused clearly.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.sampling_params import SamplingParams
from rein.model.implementation import spec_for
from rein.model.spec import UnsupportedModelError

MAX_TOKENS = 8
VOCAB = 2048   # the tiny llama tokenizer's
BLOCK = 16
# Small: every architecture shares these (spelled in each config class's own names below).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=128, max_position_embeddings=256, initializer_range=0.2,
              bos_token_id=VOCAB - 5, eos_token_id=VOCAB - 4, pad_token_id=VOCAB - 1, tie_word_embeddings=False)

ARCHITECTURES = {
    "phi3": lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=2),
    # Gemma 2's caps: the attention logits' (rein's softcapped attention path, with a window
    # shorter than the prompts) and the final logits' (in compute_logits); both low enough to matter.
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                                attn_logit_softcapping=1.0, final_logit_softcapping=5.0),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, num_key_value_heads=2),
    # Granite's multipliers: the attention scale comes from the module, the logits are divided.
    "granite": lambda: transformers.GraniteConfig(**COMMON, num_key_value_heads=2, attention_multiplier=0.2,
                                                  logits_scaling=2.0, embedding_multiplier=3.0,
                                                  residual_multiplier=0.5),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**COMMON, rotary_pct=0.5),
    "starcoder2": lambda: transformers.Starcoder2Config(**COMMON, num_key_value_heads=2),
    "cohere": lambda: transformers.CohereConfig(**COMMON, num_key_value_heads=2, logit_scale=0.5),
    # Absolute learned positions (the step's positions reach the position embedding).
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                            initializer_range=0.2, bos_token_id=VOCAB - 5, eos_token_id=VOCAB - 4),
    # Multi-query attention: one K/V head.
    "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                         n_positions=256, multi_query=True, initializer_range=0.2,
                                                         bos_token_id=VOCAB - 5, eos_token_id=VOCAB - 4),
    "phi": lambda: transformers.PhiConfig(**COMMON, partial_rotary_factor=0.5),
    # Tied embeddings: the head is the embedding table.
    "gemma": lambda: transformers.GemmaConfig(**{**COMMON, "tie_word_embeddings": True}, num_key_value_heads=1,
                                              head_dim=16),
}

# sdpa refuses attention softcapping: HF's reference runs eager attention there.
HF_ATTENTION = {"gemma2": "eager"}


@pytest.fixture(scope="module")
def tokenizer_dir(tiny_models) -> Path:
    return tiny_models("llama")


def save_model(config, out: Path, tokenizer_dir: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, VOCAB - 8) for _ in range(2 * BLOCK)]   # two whole blocks, cached once

    def tokens(n: int) -> list[int]:
        return [rng.randrange(10, VOCAB - 8) for _ in range(n)]

    return [tokens(1), tokens(5), shared + tokens(3), tokens(17), shared + tokens(9), tokens(40), tokens(24),
            shared + tokens(1)]


ARRIVALS = [0, 0, 0, 1, 1, 2, 4, 6]


def hf_greedy(model_dir: Path, prompts: list[list[int]], attention: str = "sdpa") -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                 attn_implementation=attention).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       min_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def small_engine(model_dir: Path, model_impl: str = "transformers", blocks: int = 10) -> LLMEngine:
    """A pool of `blocks` blocks (10: too few for the batch, so requests are preempted) and a
    step budget of 32 tokens (the 40-token prompt is prefilled in chunks)."""
    spec = spec_for(model_dir, model_impl)
    memory = spec.kv_bytes_per_token(torch.float32) * BLOCK * blocks
    return LLMEngine(EngineConfig(model=str(model_dir), model_impl=model_impl, device="cpu", dtype="float32",
                                  kv_cache_memory=memory, block_size=BLOCK, max_model_len=128,
                                  max_num_batched_tokens=32, enable_prefix_caching=True))


def run_engine(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    pending = sorted(range(len(prompts)), key=lambda i: ARRIVALS[i])
    step = 0
    while pending or engine.has_unfinished():
        while pending and ARRIVALS[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params)
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        step += 1
        assert step < 2_000
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_greedy_equals_hf_generate(arch, tmp_path, tokenizer_dir):
    model_dir = save_model(ARCHITECTURES[arch](), tmp_path / arch, tokenizer_dir)
    prompts = make_prompts()
    engine = small_engine(model_dir)
    assert engine.spec.family == "transformers"
    expected = hf_greedy(model_dir, prompts, HF_ATTENTION.get(arch, "sdpa"))
    assert run_engine(engine, prompts) == expected, f"{arch}: rein differs from HF generate"
    assert engine.stats.preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_llama_through_transformers_equals_native(tiny_models):
    model_dir = tiny_models("llama")
    prompts = make_prompts(seed=1)
    native = small_engine(model_dir, "rein")
    backend = small_engine(model_dir, "transformers")
    assert (native.spec.family, backend.spec.family) == ("llama", "transformers")
    assert run_engine(backend, prompts) == run_engine(native, prompts)


def test_auto_picks_native_code_where_rein_has_it(tiny_models, tmp_path, tokenizer_dir):
    assert spec_for(tiny_models("llama"), "auto").family == "llama"
    phi3 = save_model(ARCHITECTURES["phi3"](), tmp_path / "phi3", tokenizer_dir)
    spec = spec_for(phi3, "auto")
    assert (spec.family, spec.architecture, spec.num_kv_heads, spec.head_dim) == ("transformers", "Phi3ForCausalLM", 2, 16)
    with pytest.raises(UnsupportedModelError, match=r"Phi3ForCausalLM is not supported.*--model-impl transformers"):
        spec_for(phi3, "rein")


def test_spec_reads_windows_and_kv_heads_from_transformers_config(tmp_path):
    ARCHITECTURES["gemma2"]().save_pretrained(str(tmp_path / "gemma2"))
    ARCHITECTURES["gpt_bigcode"]().save_pretrained(str(tmp_path / "bigcode"))
    gemma2 = spec_for(tmp_path / "gemma2", "transformers")
    assert gemma2.layer_windows == (8, None) and gemma2.head_dim == 16
    bigcode = spec_for(tmp_path / "bigcode", "transformers")
    assert (bigcode.num_kv_heads, bigcode.head_dim, bigcode.max_position_embeddings) == (1, 16, 256)


def test_tensor_by_tensor_loading_equals_transformers_own(tmp_path, tokenizer_dir, monkeypatch):
    """The GGUF path (parameters built on the meta device, filled one tensor at a time, tied
    again) gives the model transformers' from_pretrained gives: fed here from safetensors."""
    from rein.model import loader
    from rein.model.architectures.transformers_backend import load_transformers_model
    from rein.model.files import ModelFiles

    model_dir = save_model(ARCHITECTURES["gemma"](), tmp_path / "gemma", tokenizer_dir)
    spec = spec_for(model_dir, "transformers")
    cpu = torch.device("cpu")
    reference = load_transformers_model(ModelFiles(model_dir), spec, torch.float32, cpu)
    monkeypatch.setattr(loader, "gguf_tensors", lambda gguf, directory, dtype: loader.safetensors_tensors(directory))
    filled = load_transformers_model(ModelFiles(model_dir, gguf=tmp_path / "unused.gguf"), spec, torch.float32, cpu)
    expected = reference.state_dict()
    got = filled.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    hf = filled.hf_model
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight


def write_config(directory: Path, config) -> Path:
    config.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize(("config", "reason"), [
    (lambda: transformers.T5Config(vocab_size=VOCAB, d_model=64), r"t5 is an encoder-decoder model"),
    (lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64), r"mamba has recurrent or state-space layers"),
    (lambda: transformers.Qwen3NextConfig(**{**COMMON, "num_key_value_heads": 2}),
     r"recurrent or state-space layers \(linear_attention\)"),
    (lambda: transformers.LlavaConfig(), r"llava is a multimodal model"),
    (lambda: transformers.FalconConfig(**COMMON), r"FalconForCausalLM's transformers code does not take a custom "
                                                  r"attention function"),
    (lambda: transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4), r"ALiBi"),
], ids=["t5", "mamba", "qwen3_next", "llava", "falcon", "bloom"])
def test_what_cannot_run_is_refused_with_the_reason(config, reason, tmp_path):
    directory = write_config(tmp_path / "model", config())
    with pytest.raises(UnsupportedModelError, match=reason):
        spec_for(directory, "transformers")
    with pytest.raises(UnsupportedModelError, match=reason):   # auto: no native code either
        spec_for(directory, "auto")


def test_a_model_transformers_cannot_build_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(UnsupportedModelError, match=r"transformers cannot build the model in .*no_such_model"):
        spec_for(tmp_path, "auto")


def test_model_impl_is_checked():
    with pytest.raises(ValueError, match=r"model_impl 'vllm' is not supported: use one of auto, rein, transformers"):
        EngineConfig(model="unused", model_impl="vllm")
