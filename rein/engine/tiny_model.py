"""Random-weight models of real architectures, for tests, demos, CI and benchmarks.

`make_tiny_model(out_dir, arch, seed, preset)` writes a complete Hugging Face model
directory (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, special_tokens_map.json) that `AutoModelForCausalLM` and
`AutoTokenizer` load like any downloaded checkpoint, without network access:

* The weights come from instantiating the real transformers class (LlamaForCausalLM,
  Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM and the MoE archs' classes) under
  `torch.manual_seed(seed)`, in fp32. Each architecture carries the features an inference
  engine must get right: llama3 rope scaling and untied embeddings (llama), q/k/v bias and tied embeddings
  (qwen2), q/k RMSNorm, a head_dim that differs from hidden/heads and tied embeddings
  (qwen3), plain untied with no sliding window (mistral). The mixture-of-experts archs
  carry their routers' differences: qwen3_moe renormalises the top-k weights, has an
  explicit head_dim and a dense layer (`mlp_only_layers`); qwen2_moe does not renormalise
  and adds the gated shared expert; mixtral is sparse throughout; olmoe norms the whole
  q and k projections.
* transformers initialises biases to zero and norm weights to one, which would let an
  implementation that ignores them pass; we redraw them from the same seeded generator
  (biases ~ N(0, initializer_range), norm weights ~ U(0.5, 1.5)).
* `initializer_range` is larger than the usual 0.02 so that the top-1 logit is usually
  clearly ahead of the runner-up and greedy decoding is not decided by rounding noise.
* The tokenizer is a byte-level BPE trained with `tokenizers` on Python standard library
  sources read from disk, so any (NFC) UTF-8 text round-trips and CJK characters take
  several byte tokens. Its pipeline (NFC, Qwen2 split regex, ByteLevel) is the one
  transformers' Qwen2Tokenizer imposes, so every arch tokenizes identically through
  AutoTokenizer and through tokenizer.json alone. It adds no special tokens on plain
  encode; the ChatML chat template puts `<|begin_of_text|>` and the
  `<|im_start|>`/`<|im_end|>` markers in itself.

`embedding="last" | "mean" | "cls"` writes an embedding model shaped like Qwen3-Embedding
instead: the same config (architectures still `*ForCausalLM`, plus `is_matryoshka: true`),
the base model's weights saved as sentence-transformers saves them (no `model.` prefix, no
lm_head), the sentence-transformers files that say how to pool (`modules.json`,
`1_Pooling/config.json` with that `pooling_mode_*` flag, a `Normalize` module) and a
tokenizer that appends the end-of-text token to every encoded text, as Qwen3-Embedding's
does (the last-token pooling then reads that token's state). With a tied-embedding arch
(qwen2, qwen3) the model still generates; llama and mistral, untied, then lack an LM head.

Everything is deterministic for given (arch, seed, preset, embedding) and Python
installation: two builds produce byte-identical files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import struct
import sys
from pathlib import Path
from typing import Any

from rein.engine.tiny_tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    IM_END_TOKEN,
    PAD_TOKEN,
    special_token_ids,
    train_tokenizer,
    write_json,
    write_tokenizer_files,
)

MOE_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
ARCHS = ("llama", "qwen2", "qwen3", "mistral") + MOE_ARCHS
# Poolings of `make_tiny_model(embedding=...)` (sentence-transformers' pooling_mode_* flags).
EMBEDDING_POOLINGS = ("last", "mean", "cls")

VOCAB_SIZE = 2048

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB_SIZE,
        # Logit std ~1.7, median top-1/top-2 gap ~0.3 over greedy steps (0.02 gives ~0.03
        # and degenerate repeats on qwen2/qwen3).
        "initializer_range": 0.2,
        # Qwen3 only: an explicit head_dim != hidden_size // num_attention_heads (16).
        "qwen3_head_dim": 32,
        # MoE archs: experts, experts per token, an expert's width, the shared expert's (qwen2_moe)
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
    },
    "small": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 1408,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB_SIZE,
        # Smaller than tiny's: activations grow with depth/width, and at 0.05 the logit
        # spread (std ~1.2) already matches tiny's while bf16 still agrees with fp32.
        "initializer_range": 0.05,
        # Qwen3 only: an explicit head_dim != hidden_size // num_attention_heads (64).
        "qwen3_head_dim": 128,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 352,
        "shared_expert_intermediate_size": 1408,
    },
}


# Llama 3.1-style rope scaling; original_max_position_embeddings is small so that the
# scaled band falls inside the tiny head_dim and the scaling really changes inv_freq.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

# Per architecture: transformers config/model class names, rope theta, tied embeddings.
_ARCH_SPECS: dict[str, dict[str, Any]] = {
    "llama": {
        "config_class": "LlamaConfig",
        "model_class": "LlamaForCausalLM",
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "qwen2": {
        "config_class": "Qwen2Config",
        "model_class": "Qwen2ForCausalLM",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "qwen3": {
        "config_class": "Qwen3Config",
        "model_class": "Qwen3ForCausalLM",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "config_class": "MistralConfig",
        "model_class": "MistralForCausalLM",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "config_class": "Qwen3MoeConfig",
        "model_class": "Qwen3MoeForCausalLM",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "qwen2_moe": {
        "config_class": "Qwen2MoeConfig",
        "model_class": "Qwen2MoeForCausalLM",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "mixtral": {
        "config_class": "MixtralConfig",
        "model_class": "MixtralForCausalLM",
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
    },
    "olmoe": {
        "config_class": "OlmoeConfig",
        "model_class": "OlmoeForCausalLM",
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}



def make_tiny_model(
    out_dir: str | Path, arch: str = "llama", seed: int = 0, preset: str = "tiny",
    embedding: str | None = None,
) -> Path:
    """Write a random-weight `arch` model with the `preset` shape into `out_dir`; with
    `embedding` (a pooling: last, mean or cls), an embedding model (see the module docstring).

    Returns the directory as a Path. Files already in `out_dir` with the same names are
    overwritten; others are left alone.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    if embedding is not None and embedding not in EMBEDDING_POOLINGS:
        raise ValueError(f"unknown embedding pooling {embedding!r}; expected one of {EMBEDDING_POOLINGS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = PRESETS[preset]

    tokenizer_json = train_tokenizer(shape["vocab_size"])
    ids = special_token_ids(tokenizer_json)
    if embedding is not None:
        tokenizer_json = _append_eos(tokenizer_json, ids)
    write_tokenizer_files(out, tokenizer_json, ids, shape["max_position_embeddings"])
    _write_model_files(out, arch, seed, shape, ids)
    if embedding is not None:
        _make_embedding_model(out, embedding, shape)
    return out


# What a complete tiny-model directory holds (written last: the weights).
MODEL_FILES: tuple[str, ...] = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "model.safetensors")


def ensure_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0, preset: str = "tiny",
                      embedding: str | None = None) -> Path:
    """The tiny model at `out_dir`, built first when any of its files is missing (benchmarks
    and demos reuse one build across runs)."""
    out = Path(out_dir)
    names = MODEL_FILES + (("modules.json",) if embedding is not None else ())
    if all((out / name).is_file() for name in names):
        return out
    print(f"# building a tiny {arch} ({preset}) into {out} ...", file=sys.stderr, flush=True)
    return make_tiny_model(out, arch=arch, seed=seed, preset=preset, embedding=embedding)


def model_summary(model_dir: str | Path) -> dict[str, Any]:
    """Arch, parameter count, vocab size and shape of a model directory, without torch."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    with open(model_dir / "model.safetensors", "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    params = 0
    for name, info in header.items():
        if name != "__metadata__":
            params += functools.reduce(lambda a, b: a * b, info["shape"], 1)
    return {
        "arch": config["model_type"],
        "parameters": params,
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_hidden_layers": config["num_hidden_layers"],
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


# --------------------------------------------------------------------------- weights


def _build_config(arch: str, shape: dict[str, Any], ids: dict[str, int]):
    import transformers

    spec = _ARCH_SPECS[arch]
    kwargs: dict[str, Any] = {
        "vocab_size": shape["vocab_size"],
        "hidden_size": shape["hidden_size"],
        "num_hidden_layers": shape["num_hidden_layers"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "intermediate_size": shape["intermediate_size"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "initializer_range": shape["initializer_range"],
        "tie_word_embeddings": spec["tie_word_embeddings"],
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
    }
    # transformers 5 spells rope settings as one `rope_parameters` dict that includes
    # rope_theta (the 4.x `rope_theta` + `rope_scaling` keys are still read for BC).
    rope: dict[str, Any] = {"rope_type": "default"}
    if arch == "llama":
        rope = dict(LLAMA3_ROPE)
    rope["rope_theta"] = spec["rope_theta"]
    kwargs["rope_parameters"] = rope
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = shape["qwen3_head_dim"]
    if arch in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        kwargs["use_sliding_window"] = False
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None
    if arch in MOE_ARCHS:
        kwargs["num_experts_per_tok"] = shape["num_experts_per_tok"]
        # Mixtral's and OLMoE's experts are intermediate_size wide, the Qwens' moe_intermediate_size
        kwargs["num_local_experts" if arch == "mixtral" else "num_experts"] = shape["num_experts"]
    if arch in ("qwen3_moe", "qwen2_moe"):
        kwargs["moe_intermediate_size"] = shape["moe_intermediate_size"]
    if arch == "qwen3_moe":
        kwargs["norm_topk_prob"] = True
        kwargs["mlp_only_layers"] = [shape["num_hidden_layers"] - 1]   # the last layer stays dense
    if arch == "qwen2_moe":
        kwargs["shared_expert_intermediate_size"] = shape["shared_expert_intermediate_size"]
    return getattr(transformers, spec["config_class"])(**kwargs)


def _check_config(arch: str, config: Any) -> None:
    """Guard against transformers silently dropping a feature we rely on."""
    rope = config.rope_parameters
    expected_type = "llama3" if arch == "llama" else "default"
    if rope.get("rope_type") != expected_type:
        raise RuntimeError(f"{arch}: rope_type is {rope.get('rope_type')!r}, not {expected_type!r}")
    if config.tie_word_embeddings != _ARCH_SPECS[arch]["tie_word_embeddings"]:
        raise RuntimeError(f"{arch}: tie_word_embeddings not as requested")
    if getattr(config, "sliding_window", None):   # Qwen2-MoE writes 0 for none
        raise RuntimeError(f"{arch}: sliding_window should be None")


@contextlib.contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _write_model_files(
    out: Path, arch: str, seed: int, shape: dict[str, Any], ids: dict[str, int]
) -> None:
    import torch
    import transformers

    config = _build_config(arch, shape, ids)
    _check_config(arch, config)
    model_class = getattr(transformers, _ARCH_SPECS[arch]["model_class"])
    # fork_rng: seed our build without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, shape["initializer_range"])
                elif "norm" in name:
                    param.uniform_(0.5, 1.5)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[IM_END_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
    )
    # transformers 5 always writes safetensors (`safe_serialization` is gone).
    with _quiet_progress_bars():
        model.save_pretrained(out)
    # transformers writes the weights through a private temp file (mode 0600); give them
    # the same permissions as the other files so another user/container can read them.
    weights = out / "model.safetensors"
    weights.chmod((out / "config.json").stat().st_mode & 0o777)


# --------------------------------------------------------------------------- embedding models

_POOLING_FLAGS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                  "cls": "pooling_mode_cls_token"}


def _append_eos(tokenizer_json: str, ids: dict[str, int]) -> str:
    """tokenizer.json with a post-processor that appends the end-of-text token to every
    encoded text (with add_special_tokens, the default), as Qwen3-Embedding's tokenizer
    appends <|endoftext|>: last-token pooling reads that token."""
    data = json.loads(tokenizer_json)
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": EOS_TOKEN, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": EOS_TOKEN, "type_id": 0}}],
        "special_tokens": {EOS_TOKEN: {"id": EOS_TOKEN, "ids": [ids[EOS_TOKEN]], "tokens": [EOS_TOKEN]}},
    }
    return json.dumps(data, indent=2, ensure_ascii=False)


def _make_embedding_model(out: Path, pooling: str, shape: dict[str, Any]) -> None:
    """Turn the causal LM just written into `out` into a sentence-transformers embedding model."""
    from safetensors.torch import load_file, save_file

    weights = out / "model.safetensors"
    mode = weights.stat().st_mode & 0o777
    tensors = load_file(str(weights))
    # The base model's weights only, under its own names (what AutoModel / sentence-transformers save).
    base = {name.removeprefix("model."): tensor.contiguous() for name, tensor in tensors.items()
            if not name.startswith("lm_head.")}
    save_file(base, str(weights), metadata={"format": "pt"})
    weights.chmod(mode)

    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["is_matryoshka"] = True   # vLLM's flag: `dimensions` may cut the vector
    write_json(out / "config.json", config)
    write_json(out / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    (out / "1_Pooling").mkdir(exist_ok=True)
    flags = {flag: name == pooling for name, flag in _POOLING_FLAGS.items()}
    write_json(out / "1_Pooling" / "config.json", {
        "word_embedding_dimension": shape["hidden_size"],
        "pooling_mode_cls_token": flags["pooling_mode_cls_token"],
        "pooling_mode_mean_tokens": flags["pooling_mode_mean_tokens"],
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": flags["pooling_mode_lasttoken"],
        "include_prompt": True,
    })
    write_json(out / "sentence_bert_config.json",
                {"max_seq_length": shape["max_position_embeddings"], "do_lower_case": False})
