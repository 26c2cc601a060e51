"""What the engine needs to know about a model, read from its Hugging Face config.json.

Reading the JSON ourselves (rather than through transformers' config classes) keeps the
accepted spellings explicit: transformers 4.x writes `rope_scaling` + `rope_theta`,
5.x writes `rope_parameters`; both are understood here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# architecture name in config.json -> family features
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(ValueError):
    """The model directory holds an architecture or feature rein cannot run."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hidden_act: str
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelSpec:
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise UnsupportedModelError(f"{model_dir} has no config.json: is it a Hugging Face model directory?")
        config = json.loads(config_path.read_text())
        generation = {}
        if (model_dir / "generation_config.json").is_file():
            generation = json.loads((model_dir / "generation_config.json").read_text())
        return cls.from_config(config, generation)

    @classmethod
    def from_config(cls, config: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelSpec:
        architectures = config.get("architectures") or []
        if not architectures and config.get("model_type"):
            # As transformers' Auto classes do: no architectures (GGUF-derived and hand-made
            # configs) means the model_type's causal LM.
            by_type = {family: name for name, family in SUPPORTED_ARCHITECTURES.items()}
            architectures = [by_type.get(config["model_type"], f"model_type {config['model_type']!r}")]
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {', '.join(architectures) or '(none given)'} is not supported; "
                f"rein runs: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        rope_params = dict(config.get("rope_parameters") or {})
        rope_scaling = config.get("rope_scaling") or None
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        rope_type = rope_params.get("rope_type") or rope_params.get("type")
        if rope_scaling is None and rope_type not in (None, "default"):
            rope_scaling = rope_params
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type") or rope_scaling.get("type")
            if kind in (None, "default"):
                rope_scaling = None
            elif kind not in ("llama3", "linear"):
                raise UnsupportedModelError(
                    f"rope scaling type {kind!r} is not supported; rein runs default, linear and llama3 rope"
                )
        eos = (generation or {}).get("eos_token_id", config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(config.get("attention_bias", family == "qwen2"))
        sliding = config.get("sliding_window") if config.get("use_sliding_window", family == "mistral") else None
        return cls(
            architecture=arch,
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=family == "qwen3",
            sliding_window=sliding,
            hidden_act=config.get("hidden_act", "silu"),
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
        )

    def kv_bytes_per_token(self, cache_dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes; int8 adds one fp32 scale per token and head."""
        elem = torch.empty((), dtype=cache_dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem
        if cache_dtype == torch.int8:
            per_token += 2 * self.num_layers * self.num_kv_heads * 4
        return per_token

    def num_parameters(self) -> int:
        """Parameter count from the shapes (what the weights hold)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_layers * per_layer + self.hidden_size
