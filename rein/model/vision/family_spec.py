"""The ModelSpec of a LLaVA, Idefics3 / SmolVLM or Gemma 3 (with vision) checkpoint: its text
model's spec, as rein reads that model alone, under the VLM's architecture and family.

The text model's fields come through transformers' config class, not config.json's dict: the
older LLaVA checkpoints write only what differs from LlamaConfig's defaults in `text_config`
(llava-1.5's lists its vocabulary and little else). The whole config.json is kept in
`ModelSpec.vision_config`, where the model builds its encoder from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rein.model.spec import ModelSpec, UnsupportedModelError

# architecture -> (family, the text model types it may hold)
VISION_ARCHITECTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "LlavaForConditionalGeneration": ("llava", ("llama", "mistral", "qwen2")),
    "Idefics3ForConditionalGeneration": ("idefics3", ("llama",)),
    "SmolVLMForConditionalGeneration": ("smolvlm", ("llama",)),
    "Gemma3ForConditionalGeneration": ("gemma3_vision", ("gemma3_text",)),
}
# Vision-language model_types rein refuses, and why (any-resolution tiling, video, other towers).
UNSUPPORTED = {
    "llava_next": "LLaVA-NeXT's any-resolution tiling (image_grid_pinpoints, per-tile newline embeddings) is not "
                  "implemented",
    "llava_onevision": "LLaVA-OneVision's any-resolution tiling and video input are not implemented",
    "llava_next_video": "LLaVA-NeXT-Video's any-resolution tiling and video input are not implemented",
    "mistral3": "Mistral 3's Pixtral tower (any resolution, 2-D rope) is not implemented",
    "idefics2": "Idefics2's perceiver resampler is not implemented (Idefics3 and SmolVLM are)",
    "paligemma": "PaliGemma's prefix-LM attention is not implemented (Gemma 3 with vision is)",
}


def unsupported_reason(model_type: str) -> str:
    return (f"{model_type}: {UNSUPPORTED[model_type]}; rein runs the vision models Qwen2-VL, Qwen2.5-VL, "
            f"LLaVA (1.5), Idefics3, SmolVLM and Gemma 3")


TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                      "gemma3_text": "Gemma3ForCausalLM"}


def vision_family_spec(config: dict[str, Any], generation: dict[str, Any] | None, arch: str) -> ModelSpec:
    from rein.model.vision.hf_parts import hf_config

    family, text_types = VISION_ARCHITECTURES[arch]
    try:
        full = hf_config(config)
    except Exception as exc:   # a config transformers cannot read: many kinds
        raise UnsupportedModelError(f"transformers cannot read the {arch} config: {type(exc).__name__}: {exc}") \
            from exc
    if family == "llava":
        from rein.model.vision.encoders import LLAVA_TOWERS

        tower = full.vision_config.model_type
        if tower not in LLAVA_TOWERS:
            raise UnsupportedModelError(
                f"LLaVA with a {tower!r} vision tower is not supported: rein runs LLaVA with "
                f"{' or '.join(LLAVA_TOWERS)} (one fixed image resolution)")
    text = full.text_config.to_dict()
    text_type = text.get("model_type")
    if text_type not in text_types:
        raise UnsupportedModelError(f"{arch} with a {text_type!r} text model is not supported: rein runs it with "
                                    f"{', '.join(text_types)}")
    text["architectures"] = [TEXT_ARCHITECTURES[text_type]]
    if config.get("tie_word_embeddings") is not None:   # the VLM's own setting rules (as transformers)
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    spec = ModelSpec.from_config(text, generation)
    return dataclasses.replace(spec, architecture=arch, family=family, vision_config=config)
