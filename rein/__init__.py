"""rein: a message-queue-driven batch inference service for large language models.

The offline Python API is loaded on first use, so `import rein` (and the `rein` command,
and the API process) never imports torch:

    from rein import LLM, SamplingParams

`rein.RequestOutput` is the vLLM-shaped result of one prompt (`rein.offline.llm_outputs.GenerationOutput`),
not the engine's per-step `rein.engine.step_outputs.RequestOutput`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": ("rein.offline.llm", "LLM"),
    "SamplingParams": ("rein.engine.sampling_params", "SamplingParams"),
    "PoolingParams": ("rein.model.pooling_config", "PoolingParams"),
    "EmbeddingRequestOutput": ("rein.offline.embed", "EmbeddingRequestOutput"),
    "GenerationOutput": ("rein.offline.llm_outputs", "GenerationOutput"),
    "RequestOutput": ("rein.offline.llm_outputs", "GenerationOutput"),
    "CompletionOutput": ("rein.offline.llm_outputs", "CompletionOutput"),
    "Logprob": ("rein.offline.llm_outputs", "Logprob"),
    "LoRARequest": ("rein.model.lora.request", "LoRARequest"),
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        module, attribute = _EXPORTS[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'rein' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
