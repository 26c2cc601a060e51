"""A GGUF file as a model everywhere one is named: its cached config/tokenizer view, the
engine's spec, `rein estimate`, and the API's tokenizer registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rein.model.files import TENSOR_INDEX, resolve_model

pytestmark = pytest.mark.real


def test_the_view_holds_config_tokenizer_template_and_tensor_index(gguf_path: Path):
    files = resolve_model(str(gguf_path))
    assert files.gguf == gguf_path
    for name in ("config.json", "generation_config.json", "tokenizer.json", TENSOR_INDEX):
        assert (files.directory / name).is_file(), name
    spec = files.spec
    assert (spec.architecture, spec.num_layers, spec.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152 and spec.max_position_embeddings == 8192
    tokenizer = files.load_tokenizer()
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.convert_ids_to_tokens(list(spec.eos_token_ids)) == ["<|im_end|>"]
    index = json.loads((files.directory / TENSOR_INDEX).read_text())
    assert index["architecture"] == "llama" and "blk.29.attn_q.weight" in index["tensors"]


def test_a_folder_holding_the_file_is_the_same_model(gguf_path: Path, tmp_path: Path):
    (tmp_path / gguf_path.name).symlink_to(gguf_path)
    assert resolve_model(str(tmp_path)).gguf == tmp_path / gguf_path.name
    assert resolve_model(str(tmp_path)).directory.joinpath("config.json").is_file()


def test_estimate_reads_the_shapes_of_a_gguf_file(gguf_path: Path):
    out = subprocess.run([sys.executable, "-m", "rein.cli.main", "estimate", "--model", str(gguf_path),
                          "--memory", "2GiB", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "30 layers, 9 heads, 3 KV heads, head_dim 64, max_model_len 8192" in out.stdout
    assert "134,515,008 parameters" in out.stdout


def test_the_api_serves_a_gguf_model(gguf_path: Path):
    from rein.core.settings import ServedModel
    from rein.jobs.registry import load_model

    entry = load_model(ServedModel(name="smollm2", source=str(gguf_path)))
    assert entry.max_model_len == 8192
    ids = entry.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    assert entry.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
