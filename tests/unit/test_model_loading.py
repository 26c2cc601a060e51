"""Model directories: what is accepted, and the errors for what is not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rein.engine.config import EngineConfig, parse_bytes
from rein.model.architectures.rope import inverse_frequencies
from rein.model.files import (
    GGUFSupportMissing,
    ModelNotFoundError,
    resolve_model,
)
from rein.model.spec import ModelSpec, UnsupportedModelError


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
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model(str(tmp_path / "nope"))
    assert "GGUF file" in str(info.value) and "hub id" in str(info.value)
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file but not a GGUF file"):
        resolve_model(str(tmp_path / "file.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither config.json nor a GGUF file"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match=r"holds 2 GGUF files \(a.gguf, b.gguf\)"):
        resolve_model(str(tmp_path / "two"))


def test_unreachable_hub_names_the_three_ways_to_give_a_model(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("SomeOrg/some-model")
    message = str(info.value)
    assert "network is unreachable" in message
    assert "model directory" in message and "GGUF file" in message and "hub id" in message


def test_gguf_without_the_gguf_package_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_gguf(name, *args, **kwargs):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError("No module named 'gguf'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    from rein.core.settings import get_settings

    get_settings.cache_clear()
    try:
        (tmp_path / "m.gguf").write_bytes(b"GGUF")
        with pytest.raises(GGUFSupportMissing, match=r"pip install 'rein\[gguf\]'"):
            resolve_model(str(tmp_path / "m.gguf"))
    finally:
        get_settings.cache_clear()


def test_a_gguf_view_is_read_once_and_again_when_the_file_changes(tmp_path, monkeypatch):
    """The config/tokenizer view of a GGUF file is cached by path, size and mtime."""
    from rein.core.settings import get_settings
    from rein.model import files as model_files

    monkeypatch.setenv("REIN_CACHE_DIR", str(tmp_path / "cache"))
    get_settings.cache_clear()
    writes = []

    def fake_write(gguf_path, out):
        writes.append(gguf_path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model_files, "_write_view", fake_write)
    monkeypatch.setattr(model_files, "require_gguf", lambda: None)
    try:
        model = tmp_path / "m.gguf"
        model.write_bytes(b"GGUF one")
        first = resolve_model(str(model))
        assert first.gguf == model and first.directory.parent == tmp_path / "cache" / "gguf"
        assert resolve_model(str(tmp_path)).directory == first.directory   # a folder holding one GGUF
        assert len(writes) == 1
        model.write_bytes(b"GGUF two, longer")
        assert resolve_model(str(model)).directory != first.directory
        assert len(writes) == 2
    finally:
        get_settings.cache_clear()


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
