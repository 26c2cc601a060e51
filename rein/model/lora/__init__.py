"""LoRA adapters served beside their base model (issue 44).

The pieces, and who uses them:

* `LoRARequest` (request.py): which adapter a request runs under, vLLM's shape
  (lora_name, lora_int_id, lora_path). The engine's requests carry one or None (the base).
* `load_peft_adapter` (adapters.py): an adapter directory as PEFT saves it
  (adapter_config.json + adapter_model.safetensors) read, checked against the base model and
  turned into `LoRAWeights`: per layer and per rein module (the fused qkv_proj and gate_up_proj
  included: a PEFT q_proj is a slice of rein's qkv_proj), the A [r, in] and B [out, r] matrices
  with the scaling folded into B (lora_alpha / r, rsLoRA's lora_alpha / sqrt(r), and
  rank_pattern / alpha_pattern per module). Anything wrong raises `AdapterError`, whose message
  says what and what to change.
* `load_gguf_adapter` (gguf_adapter.py): the same for an adapter in llama.cpp's GGUF form
  (convert_lora_to_gguf.py's file); load_peft_adapter hands a .gguf path to it.
* `LoRAModel` (layers.py): the model side. `enable_lora(model, max_loras, max_rank)` gives a
  loaded rein model `max_loras` device slots; `activate(slot, weights)` copies an adapter into
  a slot, `deactivate(slot)` empties it; `with lora_model.step(token_slots):` runs a forward in
  which token t gets its slot's products added (token_slots[t] = -1: the base alone). The
  products are grouped by adapter: a C kernel on a float32 CPU model, Triton shrink/expand
  kernels on CUDA (rein.kernels.triton_lora), grouped torch matmuls otherwise.
* `local_adapter` (fetch.py): an s3:// adapter path fetched once per machine into the cache.
* `shard_adapter` (sharding.py): under tensor parallelism, what `load_peft_adapter` returns is the
  rank's shard of the adapter, cut as the rank's projections are (B's rows for the column-parallel
  qkv_proj and gate_up_proj, A's columns for the row-parallel o_proj and down_proj).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from rein.model.lora.request import LoRARequest

# The torch-side names load on first use, so that importing LoRARequest stays light.
_LAZY = {
    "AdapterError": "rein.model.lora.config",
    "LoRATarget": "rein.model.lora.adapters",
    "LoRAWeights": "rein.model.lora.adapters",
    "load_peft_adapter": "rein.model.lora.adapters",
    "LoRAModel": "rein.model.lora.layers",
    "enable_lora": "rein.model.lora.layers",
}

__all__ = ["LoRARequest", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
