"""Which LoRA adapter a request runs under: vLLM's LoRARequest, so offline code written for vLLM
(`llm.generate(prompts, lora_request=LoRARequest("sql", 1, "/adapters/sql"))`) runs on rein."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (what a request's `model` says); lora_int_id: a positive
    id unique per adapter, which keys the adapter's slot and its prefix-cache entries;
    lora_path: its directory (adapter_config.json + adapter_model.safetensors, as PEFT saves
    it); base_model_name: when set, the base it must have been trained on (else the adapter's
    own `base_model_name_or_path` is checked against the served model's name)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id} "
                             f"(0 is the base model)")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
