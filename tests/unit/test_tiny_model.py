"""rein.fixtures.tiny_model and `rein make-tiny-model`: random-weight models of real architectures."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rein.fixtures.tiny_model import ARCHS, PRESETS, VOCAB_SIZE, make_tiny_model, model_summary

EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

TEXT = "def 函数(x):\n    return '你好，世界' + str(x)  # café 🙂\r\n\tend"


def read_config(model_dir: Path, name: str = "config.json") -> dict:
    return json.loads((model_dir / name).read_text(encoding="utf-8"))


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_builds_and_loads_with_transformers(tiny_models, arch):
    model_dir = tiny_models(arch)
    for name in EXPECTED_FILES:
        assert (model_dir / name).is_file(), name
    config = read_config(model_dir)
    assert config["model_type"] == arch
    assert config["architectures"] == [MODEL_CLASSES[arch]]
    assert config["vocab_size"] == VOCAB_SIZE
    assert config["dtype"] == "float32"

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == MODEL_CLASSES[arch]
    assert model.dtype == torch.float32
    assert len(tok) == config["vocab_size"]

    ids = tok(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE)
    assert torch.isfinite(logits).all()
    assert model_summary(model_dir)["parameters"] == sum(p.numel() for p in model.parameters())


def test_llama_has_llama3_rope_scaling_and_untied_embeddings(tiny_models):
    model_dir = tiny_models("llama")
    config = read_config(model_dir)
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "llama3"
    assert rope["factor"] == 8.0
    assert rope["low_freq_factor"] == 1.0
    assert rope["high_freq_factor"] == 4.0
    assert rope["original_max_position_embeddings"] < config["max_position_embeddings"]
    assert config["tie_word_embeddings"] is False

    weights = tensors(model_dir)
    assert "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert not any(key.endswith(".bias") for key in weights)

    # The scaling really takes effect: the loaded rotary frequencies differ from plain RoPE.
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    head_dim = config["head_dim"]
    plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    scaled = model.model.rotary_emb.inv_freq.float()
    assert scaled[0] == pytest.approx(plain[0].item())  # highest frequency untouched
    assert scaled[-1] == pytest.approx(plain[-1].item() / rope["factor"])  # lowest scaled by 8


def test_qwen2_has_qkv_bias_and_tied_embeddings(tiny_models):
    model_dir = tiny_models("qwen2")
    config = read_config(model_dir)
    assert config["tie_word_embeddings"] is True
    weights = tensors(model_dir)
    assert "lm_head.weight" not in weights
    for layer in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj", "v_proj"):
            bias = weights[f"model.layers.{layer}.self_attn.{proj}.bias"]
            assert bias.abs().sum() > 0  # redrawn, not transformers' all-zero init
        assert f"model.layers.{layer}.self_attn.o_proj.bias" not in weights

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_qwen3_has_qk_norm_explicit_head_dim_and_tied_embeddings(tiny_models):
    model_dir = tiny_models("qwen3")
    config = read_config(model_dir)
    head_dim = config["head_dim"]
    assert head_dim == PRESETS["tiny"]["qwen3_head_dim"]
    assert head_dim != config["hidden_size"] // config["num_attention_heads"]
    assert config["tie_word_embeddings"] is True

    weights = tensors(model_dir)
    assert "lm_head.weight" not in weights
    q_norm = weights["model.layers.0.self_attn.q_norm.weight"]
    assert q_norm.shape == (head_dim,)
    assert not torch.all(q_norm == 1.0)  # redrawn, not transformers' all-one init
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (head_dim,)
    assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (
        config["num_attention_heads"] * head_dim,
        config["hidden_size"],
    )
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (
        config["num_key_value_heads"] * head_dim,
        config["hidden_size"],
    )
    assert not any(key.endswith(".bias") for key in weights)


def test_mistral_is_untied_without_sliding_window(tiny_models):
    model_dir = tiny_models("mistral")
    config = read_config(model_dir)
    assert config["sliding_window"] is None
    assert config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_type"] == "default"
    weights = tensors(model_dir)
    assert "lm_head.weight" in weights
    assert not any(key.endswith(".bias") for key in weights)


def test_gqa_shapes(tiny_models):
    config = read_config(tiny_models("llama"))
    assert config["num_key_value_heads"] < config["num_attention_heads"]


def test_deterministic_for_a_seed_and_different_for_another(tiny_models, tmp_path):
    first = file_hashes(tiny_models("llama"))
    again = file_hashes(make_tiny_model(tmp_path / "again", arch="llama", seed=0))
    assert again == first

    other = file_hashes(make_tiny_model(tmp_path / "other", arch="llama", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_tokenizer_trains_deterministically():
    from rein.fixtures.tiny_tokenizer import train_tokenizer

    cached = train_tokenizer(VOCAB_SIZE)
    train_tokenizer.cache_clear()
    assert train_tokenizer(VOCAB_SIZE) == cached


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    make_tiny_model(tmp_path, arch="mistral", seed=7)
    assert torch.equal(torch.get_rng_state(), state)


def test_chinese_round_trips_and_splits_into_byte_tokens(tokenizer):
    ids = tokenizer(TEXT).input_ids
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer("你").input_ids) > 1
    assert sum(len(tokenizer(ch).input_ids) > 1 for ch in "函数你好世界") >= 1


def test_plain_encode_adds_no_special_tokens(tokenizer):
    ids = tokenizer("hello world").input_ids
    assert tokenizer.bos_token_id not in ids
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids) == "hello world"


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_tokenizer_matches_tokenizer_json(tiny_models, arch):
    # transformers rebuilds some tokenizers (Qwen2Tokenizer for model_type qwen2) from
    # vocab/merges; the result must still equal tokenizer.json run by `tokenizers` alone.
    model_dir = tiny_models(arch)
    auto = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in (TEXT, "x = 12345  it's I'M\n\n\n  spaces", "<|im_start|>user\nhi<|im_end|>"):
        assert auto(text).input_ids == raw.encode(text).ids
    assert len(auto) == raw.get_vocab_size() == VOCAB_SIZE


@pytest.mark.parametrize("arch", ARCHS)
def test_special_token_ids_are_consistent(tiny_models, arch):
    model_dir = tiny_models(arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    config = read_config(model_dir)
    generation = read_config(model_dir, "generation_config.json")
    bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
    eot = tok.convert_tokens_to_ids("<|end_of_text|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert len({bos, eot, im_start, im_end, tok.pad_token_id}) == 5
    assert all(0 <= i < config["vocab_size"] for i in (bos, eot, im_start, im_end))
    assert tok.bos_token_id == bos and tok.eos_token_id == eot
    for cfg in (config, generation):
        assert cfg["bos_token_id"] == bos
        assert cfg["eos_token_id"] == [eot, im_end]
        assert cfg["pad_token_id"] == tok.pad_token_id


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "More?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|begin_of_text|>"
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\nHi.<|im_end|>\n"
        "<|im_start|>user\nMore?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not closed.endswith("<|im_start|>assistant\n")

    ids = tokenizer(prompt).input_ids
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 5
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_top1_margin_is_clear(tiny_models, arch):
    model_dir = tiny_models(arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("def main():\n", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    scores = torch.stack(out.scores)[:, 0]
    assert torch.isfinite(scores).all()
    top2 = scores.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 1e-2
    assert len(set(out.sequences[0, ids.shape[1] :].tolist())) > 4  # not one repeated token


def test_rejects_unknown_arch_and_preset(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="preset"):
        make_tiny_model(tmp_path, preset="huge")


def test_presets():
    for preset in ("tiny", "small"):
        shape = PRESETS[preset]
        assert shape["vocab_size"] == VOCAB_SIZE
        assert shape["max_position_embeddings"] == 2048
        assert shape["num_attention_heads"] % shape["num_key_value_heads"] == 0
    assert PRESETS["tiny"]["hidden_size"] == 64 and PRESETS["tiny"]["num_hidden_layers"] == 2
    assert PRESETS["small"]["hidden_size"] == 512 and PRESETS["small"]["num_hidden_layers"] == 8


def test_cli_parser_defaults():
    from rein.cli import make_tiny_model as cli

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["make-tiny-model", "out"])
    # arch None: llama, or qwen3 with --embedding (decided when the command runs)
    assert (args.dir, args.arch, args.seed, args.preset, args.embedding) == ("out", None, 0, "tiny", False)
    args = parser.parse_args(
        ["make-tiny-model", "out", "--arch", "qwen3", "--seed", "3", "--preset", "small"]
    )
    assert (args.arch, args.seed, args.preset) == ("qwen3", 3, "small")
    with pytest.raises(SystemExit):
        parser.parse_args(["make-tiny-model", "out", "--arch", "gpt2"])


def test_cli_main_builds_a_model(tmp_path, capsys):
    from rein.cli.main import main

    out = tmp_path / "qwen3"
    assert main(["make-tiny-model", str(out), "--arch", "qwen3"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    assert "arch=qwen3" in printed and f"vocab={VOCAB_SIZE}" in printed
    assert read_config(out)["model_type"] == "qwen3"
    AutoModelForCausalLM.from_pretrained(out)


def test_cli_builds_an_embedding_model(tmp_path, capsys):
    """Shaped like Qwen3-Embedding: a *ForCausalLM config, base-model weights without lm_head,
    sentence-transformers pooling files, a tokenizer appending the end-of-text token."""
    from rein.cli.main import main
    from rein.model.pooling_config import read_pooling_config

    out = tmp_path / "embed"
    assert main(["make-tiny-model", str(out), "--embedding", "--pooling", "mean"]) == 0
    assert "arch=qwen3 embedding pooling=mean" in capsys.readouterr().out
    config = read_config(out)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["is_matryoshka"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
    assert "embed_tokens.weight" in names and "norm.weight" in names
    assert not any(name.startswith(("model.", "lm_head.")) for name in names)
    pooling = read_pooling_config(out)
    assert (pooling.pooling_type, pooling.normalize, pooling.hidden_size) == ("mean", True, 64)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("hello")[-1] == tokenizer.eos_token_id
    assert tokenizer.encode("hello", add_special_tokens=False)[-1] != tokenizer.eos_token_id
    assert main(["make-tiny-model", str(tmp_path / "x"), "--pooling", "mean"]) == 2   # needs --embedding


def test_ensure_tiny_model_reuses_a_complete_build_and_rebuilds_a_partial_one(tmp_path):
    from rein.fixtures.tiny_model import MODEL_FILES, ensure_tiny_model

    out = ensure_tiny_model(tmp_path / "m")
    weights = out / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert ensure_tiny_model(out) == out and weights.stat().st_mtime_ns == first
    (out / MODEL_FILES[0]).unlink()
    ensure_tiny_model(out)
    assert all((out / name).is_file() for name in MODEL_FILES)
