"""Which code runs a model (`--model-impl`): rein's native model, read by ModelSpec, or the
Transformers backend (rein.model.architectures.transformers_backend) for every other causal LM, whose
spec is read from transformers' own config object after refusing what rein's engine cannot run
(encoder-decoder, multimodal-only, recurrent or state-space layers, ALiBi, MLA), and with the
repository's own code only under `--trust-remote-code`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rein.model import tokenizer_files
from rein.model.implementation_names import check_model_impl
from rein.model.spec import ModelSpec, UnsupportedModelError

TRANSFORMERS_FAMILY = "transformers"
# The layer kinds rein's paged KV cache serves; any other kind in `layer_types` keeps some
# other state (mamba, linear attention, convolutions) or another mask (chunked attention).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Recurrent and state-space models whose configs name no layer_types (or mix them by other fields).
_RECURRENT_MODEL_TYPES = {"mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba",
                          "falcon_h1", "nemotron_h", "granitemoehybrid", "recurrent_gemma", "xlstm", "lfm2",
                          "plamo2", "minimax", "qwen3_next"}
_STATE_FIELDS = ("state_size", "ssm_state_size", "mamba_d_state", "linear_conv_kernel_dim")
# Position biases added to the attention scores, which the paged kernels do not take.
_ALIBI_MODEL_TYPES = {"bloom", "mpt", "baichuan"}


def spec_for(model_dir: str | Path, model_impl: str = "auto", trust_remote_code: bool = False) -> ModelSpec:
    """The spec of the model in `model_dir` under `--model-impl`: `rein` its native code only,
    `transformers` the Transformers backend, `auto` native code where rein has it (and can run
    the config's features), else the Transformers backend. `trust_remote_code`: the backend
    may run the repository's own modeling code (a model that needs it is refused without)."""
    check_model_impl(model_impl)
    if model_impl == "transformers":
        return transformers_spec(model_dir, trust_remote_code)
    try:
        return ModelSpec.from_dir(model_dir)
    except UnsupportedModelError as native:
        if model_impl == "rein":
            raise UnsupportedModelError(
                f"{native}; --model-impl transformers (or auto) runs other causal LMs through their "
                f"transformers modeling code") from None
        try:
            return transformers_spec(model_dir, trust_remote_code)
        except UnsupportedModelError as backend:
            raise UnsupportedModelError(f"{backend} (and rein's native code: {native})") from None


def check_shardable(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """ValueError when the model of `spec` cannot be sharded over `tensor_parallel_size` ranks
    because the Transformers backend runs it (its modeling code is never sharded): the one check,
    for the engine before it starts any rank and for the loader."""
    if tensor_parallel_size > 1 and spec.family == TRANSFORMERS_FAMILY:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs one of rein's native models; "
                         f"{spec.architecture} runs on the Transformers backend, which is not sharded: use "
                         f"tensor_parallel_size 1")


def transformers_spec(model_dir: str | Path, trust_remote_code: bool = False) -> ModelSpec:
    """A spec with family "transformers", read from transformers' own config object (so every
    architecture's field names are understood as transformers understands them), after the
    refusals of what rein's engine cannot run (`check_transformers_config`)."""
    model_dir = Path(model_dir)
    if not trust_remote_code:
        # Not an UnsupportedModelError: under --model-impl auto the flag, not rein's missing
        # native code, is what to act on.
        check_model_code(model_dir)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:  # unknown model_type, no or bad config.json: many kinds
        raise UnsupportedModelError(
            f"transformers cannot build the model in {model_dir}: {type(exc).__name__}: {exc}") from exc
    architecture = check_transformers_config(config, causal_lm_class(config, model_dir, trust_remote_code))
    text = config.get_text_config()
    generation = {}
    if (model_dir / "generation_config.json").is_file():
        generation = json.loads((model_dir / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", getattr(text, "eos_token_id", None))
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) or ()
    # Windows only where the config says which layers have them: a layer the spec calls full
    # keeps its whole context in the cache, which is safe whatever its attention does.
    windows = tuple(int(window) if window and kind == "sliding_attention" else None for kind in types)
    dtype = getattr(config, "dtype", None)
    return ModelSpec(
        architecture=architecture,
        family=TRANSFORMERS_FAMILY,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=_kv_heads(text),
        head_dim=head_dim,
        # The model's own code applies its MLP, norms and positions; these fields only feed
        # `rein estimate`'s parameter count.
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        attention_bias=False,
        qk_norm=False,
        sliding_window=max((w for w in windows if w), default=None),
        hidden_act=str(getattr(text, "hidden_act", "")),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        bos_token_id=getattr(text, "bos_token_id", None),
        torch_dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        layer_windows=windows or (None,) * text.num_hidden_layers,
    )


def check_model_code(model_dir: Path) -> None:
    """RemoteCodeRequired when transformers can build the model only from the repository's own
    code: config.json's auto_map names its config or causal LM class and transformers does not
    know the model_type (a known one it builds from its own code, as transformers does)."""
    from transformers import CONFIG_MAPPING

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    auto_map = config.get("auto_map") or {}
    code = [f"{name}: {auto_map[name]}" for name in ("AutoConfig", "AutoModelForCausalLM") if auto_map.get(name)]
    if code and config.get("model_type") not in CONFIG_MAPPING:
        raise tokenizer_files.RemoteCodeRequired(f"the model in {model_dir} is the repository's own code ({', '.join(code)} in "
                                 f"config.json's auto_map); {tokenizer_files.REMOTE_CODE_HINT}")


def causal_lm_class(config: Any, model_dir: Path, trust_remote_code: bool) -> type | None:
    """The class AutoModelForCausalLM builds for `config`: the repository's own (auto_map) when
    remote code is trusted, as transformers prefers it then; else transformers' (None: none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    reference = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if trust_remote_code and reference:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        return get_class_from_dynamic_module(reference, str(model_dir))
    return MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)


def check_transformers_config(config: Any, model_class: type | None) -> str:
    """The name of `model_class`, the causal LM class transformers builds for `config`;
    UnsupportedModelError naming the reason for a model rein's engine cannot run through it."""
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{kind} is an encoder-decoder model: rein runs decoder-only causal LMs")
    text = config.get_text_config()
    if text is not config:
        raise UnsupportedModelError(
            f"{kind} is a multimodal model (its text model is {text.model_type}): rein takes text inputs "
            f"only; a text-only checkpoint of the model may run")
    layer_kinds = sorted(set(getattr(config, "layer_types", None) or ()) - set(_ATTENTION_LAYER_TYPES))
    recurrent = kind in _RECURRENT_MODEL_TYPES or any(getattr(config, f, None) for f in _STATE_FIELDS)
    if recurrent or layer_kinds:
        listed = ", ".join(layer_kinds)
        what = ("recurrent or state-space layers" + (f" ({listed})" if listed else "")) if recurrent \
            else f"{listed} layers"
        raise UnsupportedModelError(
            f"{kind} has {what}: rein's paged KV cache serves full and sliding-window attention layers only")
    if kind in _ALIBI_MODEL_TYPES or getattr(config, "alibi", False):
        raise UnsupportedModelError(f"{kind} uses ALiBi position biases, which rein's paged attention lacks")
    if getattr(config, "kv_lora_rank", None):
        raise UnsupportedModelError(f"{kind} uses multi-head latent attention (kv_lora_rank), not supported")
    if model_class is None:
        raise UnsupportedModelError(f"transformers has no causal LM for model type {kind!r}")
    if not model_class._supports_attention_backend:
        raise UnsupportedModelError(
            f"{model_class.__name__}'s transformers code does not take a custom attention function "
            f"(_supports_attention_backend is False), which the Transformers backend plugs rein's into")
    return model_class.__name__


def _kv_heads(text: Any) -> int:
    """K/V heads as the attention modules project them: multi-query models keep one (Falcon's
    new decoder architecture excepted, as in transformers)."""
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        return 1
    for name in ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"):
        if getattr(text, name, None):
            return int(getattr(text, name))
    return text.num_attention_heads
