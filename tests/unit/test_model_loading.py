"""Model directories: what is accepted, and the errors for what is not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rein.engine.config import EngineConfig, parse_bytes
from rein.engine.model_spec import ModelSpec, UnsupportedModelError
from rein.engine.models.rope import inverse_frequencies
from rein.model_files import ModelNotFoundError, resolve_model_dir


def test_unsupported_architecture_names_the_supported_ones(tiny_models, tmp_path):
    model = tmp_path / "gpt2ish"
    shutil.copytree(tiny_models("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        ModelSpec.from_dir(model)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


@pytest.mark.parametrize("arch,bias,qk_norm,tied", [
    ("llama", False, False, False), ("qwen2", True, False, True),
    ("qwen3", False, True, True), ("mistral", False, False, False),
])
def test_spec_reads_family_features(tiny_models, arch, bias, qk_norm, tied):
    spec = ModelSpec.from_dir(tiny_models(arch))
    assert (spec.attention_bias, spec.qk_norm, spec.tie_word_embeddings) == (bias, qk_norm, tied)
    assert spec.eos_token_ids


def test_llama3_rope_scaling_is_read_and_matches_transformers(tiny_models):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_dir = tiny_models("llama")
    spec = ModelSpec.from_dir(model_dir)
    assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "llama3"
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(model_dir), torch.device("cpu"))
    ours = inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    assert torch.equal(ours, hf_inv_freq.float())


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model_dir(str(tmp_path / "file.bin"))


def test_config_validation_and_sizes():
    assert parse_bytes("24GiB") == 24 * 1024**3
    assert parse_bytes("512MB") == 512 * 1000**2
    assert parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="m", kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(model="m", block_size=12)
    assert EngineConfig(model="m", device="cpu").torch_dtype == torch.float32
    assert EngineConfig(model="m", device="cpu", kv_cache_dtype="int8").cache_torch_dtype == torch.int8
