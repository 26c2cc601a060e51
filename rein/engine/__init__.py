"""The inference engine: continuous batching over a paged KV cache.

Usable on its own (offline `rein run-batch`, `rein generate`); imports torch,
transformers and safetensors, never Redis, SQL or Celery. The names below are loaded on
first use, so importing a light submodule (sampling_params, errors) stays cheap.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ContextLengthExceeded": "rein.engine.errors",
    "EngineConfig": "rein.engine.config",
    "EngineRequestError": "rein.engine.errors",
    "EngineClient": "rein.engine.client",
    "EngineStats": "rein.engine.engine",
    "EngineStoppedError": "rein.engine.client",
    "LLMEngine": "rein.engine.engine",
    "PoolingParams": "rein.model.pooling_config",
    "RequestOutput": "rein.engine.step_outputs",
    "RequestStream": "rein.engine.client",
    "SamplingParams": "rein.engine.sampling_params",
    "SamplingParamsError": "rein.engine.sampling_params",
    "TokenLogprob": "rein.engine.step_outputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rein.engine' has no attribute {name!r}")
