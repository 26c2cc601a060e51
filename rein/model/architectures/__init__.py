"""rein's native model implementations, one module per layer shape, chosen by the spec's family.

The "transformers" family (any other causal LM, run by its own transformers code with rein's
attention: transformers_backend) is built by rein.model.loader, not from this table."""

from __future__ import annotations

from importlib import import_module

from rein.model.spec import ModelSpec

# family -> "module:class"; imported when a model of that family loads.
NATIVE_MODELS = {
    "llama": "rein.model.architectures.llama:LlamaFamilyModel",
    "mistral": "rein.model.architectures.llama:LlamaFamilyModel",
    "qwen2": "rein.model.architectures.llama:LlamaFamilyModel",
    "qwen3": "rein.model.architectures.llama:LlamaFamilyModel",
    "gemma3": "rein.model.architectures.gemma3:Gemma3Model",
    "qwen3_moe": "rein.model.architectures.moe_family:MoeFamilyModel",
    "qwen2_moe": "rein.model.architectures.moe_family:MoeFamilyModel",
    "mixtral": "rein.model.architectures.moe_family:MoeFamilyModel",
    "olmoe": "rein.model.architectures.moe_family:MoeFamilyModel",
    "qwen2_vl": "rein.model.vision.qwen2_vl:Qwen2VLModel",
    "qwen2_5_vl": "rein.model.vision.qwen2_vl:Qwen2VLModel",
}


def native_model_class(spec: ModelSpec) -> type:
    module, _, name = NATIVE_MODELS[spec.family].partition(":")
    return getattr(import_module(module), name)
