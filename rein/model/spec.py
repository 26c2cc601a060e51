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
    "Gemma3ForCausalLM": "gemma3",
    # Mixture-of-experts (rein.model.architectures.moe_family)
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    # Vision-language (rein.model.vision): the Qwen2 text model with M-RoPE, and a vision tower.
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
# Families that take images: their config.json nests the text model's fields in `text_config`
# (transformers 5) or keeps them at the top level (older checkpoints); `vision_config` is whole
# in ModelSpec.vision_config.
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# config.json's model_type of each family (for configs that name no architecture)
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text",
               "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe", "mixtral": "mixtral", "olmoe": "olmoe",
               "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl"}


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
    # Per layer: its attention window (the last N positions) or None for full attention.
    layer_windows: tuple[int | None, ...] = ()
    # Rope base of the windowed layers where it differs from the full ones' (Gemma 3: 10k vs 1M;
    # they take no rope scaling).
    local_rope_theta: float | None = None
    attention_scale: float = 0.0     # softmax scale; 0 means head_dim ** -0.5
    # Mixture-of-experts: each sparse layer routes a token to `num_experts_per_tok` of
    # `num_experts` gated MLPs of `moe_intermediate_size`, weighted by the router's softmax
    # (renormalised over the chosen ones when `norm_topk_prob`), plus a shared expert of
    # `shared_expert_intermediate_size` where nonzero (Qwen2-MoE). Dense layers keep an MLP
    # of `intermediate_size`. All zero / empty for a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    # Per layer: True where the MLP is the sparse MoE block.
    sparse_layers: tuple[bool, ...] = ()
    # Vision-language models: M-RoPE's split of the rotary frequencies over (t, h, w) positions
    # (Qwen2-VL), and the whole config.json (the vision tower is built from it); None otherwise.
    mrope_section: tuple[int, ...] | None = None
    vision_config: dict[str, Any] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (self.sliding_window,) * self.num_layers)
        if not self.sparse_layers:
            object.__setattr__(self, "sparse_layers", (self.num_experts > 0,) * self.num_layers)
        if not self.attention_scale:
            object.__setattr__(self, "attention_scale", self.head_dim**-0.5)

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def windowed_layers(self) -> int:
        return sum(window is not None for window in self.layer_windows)

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
            by_type = {MODEL_TYPES[family]: name for name, family in SUPPORTED_ARCHITECTURES.items()}
            architectures = [by_type.get(config["model_type"], f"model_type {config['model_type']!r}")]
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {', '.join(architectures) or '(none given)'} is not supported; "
                f"rein runs: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        full_config = config
        mrope_section = None
        if family in VISION_FAMILIES:
            config = {**config, **(config.get("text_config") or {})}
            rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
            mrope_section = tuple(rope.get("mrope_section") or ()) or None
            # M-RoPE is ordinary rope with 3-D positions: the frequencies are the default ones.
            config = {**config, "rope_scaling": None,
                      "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta",
                                                                                        config.get("rope_theta", 1e6))}}
            config.pop("rope_theta", None)
        hidden = config["hidden_size"]
        heads = config["num_attention_heads"]
        rope_params = dict(config.get("rope_parameters") or {})
        local_rope_theta = None
        if "full_attention" in rope_params:
            # transformers 5 writes one rope per layer type (Gemma 3); the local ones take no scaling.
            local_rope_theta = rope_params.get("sliding_attention", {}).get("rope_theta")
            rope_params = dict(rope_params["full_attention"])
        elif family == "gemma3":
            local_rope_theta = config.get("rope_local_base_freq", 10000.0)
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
        attention_bias = bool(config.get("attention_bias", family in ("qwen2",) + VISION_FAMILIES))
        if family == "qwen2_moe":   # its config names the q/k/v bias qkv_bias (on unless set off)
            attention_bias = bool(config.get("qkv_bias", True))
        num_layers = config["num_hidden_layers"]
        moe = _moe_fields(config, family, arch, num_layers) if family in MOE_FAMILIES else {}
        sliding, windows = _windows(config, family, num_layers)
        if family == "gemma3":
            for softcap in ("attn_logit_softcapping", "final_logit_softcapping"):
                if config.get(softcap) is not None:
                    raise UnsupportedModelError(f"{arch} with {softcap} set is not supported natively")
        head_dim = config.get("head_dim") or hidden // heads
        scalar = config.get("query_pre_attn_scalar") if family == "gemma3" else None
        return cls(
            architecture=arch,
            family=family,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            intermediate_size=config["intermediate_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=family in ("qwen3", "gemma3", "qwen3_moe", "olmoe"),
            sliding_window=sliding,
            hidden_act=config.get("hidden_activation") or config.get("hidden_act", "silu"),
            eos_token_ids=eos_ids,
            bos_token_id=config.get("bos_token_id"),
            torch_dtype=config.get("torch_dtype") or config.get("dtype"),
            layer_windows=windows,
            local_rope_theta=None if local_rope_theta is None else float(local_rope_theta),
            attention_scale=float(scalar) ** -0.5 if scalar else head_dim**-0.5,
            mrope_section=mrope_section,
            vision_config=full_config if family in VISION_FAMILIES else None,
            **moe,
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
            # OLMoE normalises the whole q and k projections, the others each head
            attn += q + kv if self.family == "olmoe" else 2 * self.head_dim
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        sparse_mlp = self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
        if self.shared_expert_intermediate_size:   # its gated MLP and its 1-wide sigmoid gate
            sparse_mlp += 3 * self.hidden_size * self.shared_expert_intermediate_size + self.hidden_size
        norms = 4 if self.family == "gemma3" else 2   # Gemma 3 norms before and after both halves
        per_layer = attn + norms * self.hidden_size
        mlps = sum(sparse_mlp if sparse else dense_mlp for sparse in self.sparse_layers)
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_layers * per_layer + mlps + self.hidden_size


# MoE family -> transformers' defaults for (num_experts, num_experts_per_tok), used where
# config.json omits them.
MOE_FAMILIES = {"qwen3_moe": (128, 8), "qwen2_moe": (60, 4), "mixtral": (8, 2), "olmoe": (64, 8)}


def _moe_fields(config: dict[str, Any], family: str, arch: str, num_layers: int) -> dict[str, Any]:
    """The ModelSpec MoE fields, with transformers' defaults where config.json omits a key.

    Qwen2/3-MoE make layer i sparse when (i + 1) % decoder_sparse_step == 0 and i is not in
    mlp_only_layers; Mixtral and OLMoE are sparse throughout, their experts as wide as
    `intermediate_size`. Mixtral always renormalises the top-k weights (a softmax over the
    chosen logits); the others when `norm_topk_prob` (off by default)."""
    default_experts, default_top_k = MOE_FAMILIES[family]
    # transformers 5 writes Qwen3-MoE's and Mixtral's as num_local_experts, OLMoE's and the
    # released Qwen checkpoints' as num_experts
    experts = config.get("num_experts") or config.get("num_local_experts") or default_experts
    if family == "olmoe" and config.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"{arch} with clip_qkv set is not supported natively")
    if family in ("qwen3_moe", "olmoe") and config.get("attention_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias set is not supported natively")
    if family in ("qwen3_moe", "qwen2_moe"):
        step = config.get("decoder_sparse_step") or 1
        dense = set(config.get("mlp_only_layers") or ())
        sparse = tuple((i + 1) % step == 0 and i not in dense for i in range(num_layers))
        expert_size = config.get("moe_intermediate_size") or config["intermediate_size"]
    else:
        sparse = (True,) * num_layers
        expert_size = config["intermediate_size"]
    shared = config.get("shared_expert_intermediate_size", 5632) if family == "qwen2_moe" else 0
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(config.get("num_experts_per_tok") or default_top_k),
        "moe_intermediate_size": int(expert_size),
        "norm_topk_prob": True if family == "mixtral" else bool(config.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(shared or 0),
        "sparse_layers": sparse,
    }


def _windows(config: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, tuple[int | None, ...]]:
    """The sliding window and which layers use it, as transformers decides: `layer_types` where
    the config lists them; otherwise Gemma 3 windows all layers but every
    `sliding_window_pattern`-th, Mistral all when `sliding_window` is set, Qwen2/3 those from
    `max_window_layers` on when `use_sliding_window` is set."""
    window = config.get("sliding_window")
    if family == "gemma3":
        enabled = True
    else:
        enabled = bool(config.get("use_sliding_window", family in ("mistral", "mixtral")))
    if not window or not enabled:
        return None, (None,) * num_layers
    types = config.get("layer_types")
    if types:
        windowed = [kind == "sliding_attention" for kind in types]
    elif family == "gemma3":
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or 6
        windowed = [(i + 1) % pattern != 0 for i in range(num_layers)]
    elif family in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", num_layers)
        windowed = [i >= first for i in range(num_layers)]
    elif family == "qwen2_moe":   # transformers' rule when the config lists no layer_types
        below = config.get("max_window_layers", 28)
        windowed = [(i + 1) % 2 == 1 and i < below for i in range(num_layers)]
    else:
        windowed = [True] * num_layers
    if len(windowed) != num_layers:
        raise UnsupportedModelError(f"layer_types lists {len(windowed)} layers, the model has {num_layers}")
    windows = tuple(int(window) if w else None for w in windowed)
    return (int(window) if any(windowed) else None), windows
