"""The `--quantization` names, defined once and torch-free: the flags and `rein.LLM`'s keyword
(rein.engine.options) list them, EngineConfig checks a value against them (`check_quantization`),
and the loader (rein.model.quant.checkpoint) reads the method and group size from them.

"auto" keeps what the checkpoint has (GGUF blocks, AWQ, GPTQ; float stays float), "none"
dequantizes everything to --dtype, int8 / int4 quantize float weights at load (int4 in groups of
128, or int4-gN). "awq", "gptq", "gguf" (vLLM's names for the checkpoint's own method) mean auto
once the checkpoint is seen to be one.
"""

from __future__ import annotations

INT4_GROUPS = (32, 64, 128, 256)
DEFAULT_INT4_GROUP = 128
CHECKPOINT_METHODS = ("awq", "gptq", "gguf")
QUANTIZATIONS = ("auto", "none", "int8", "int4", *(f"int4-g{g}" for g in INT4_GROUPS), *CHECKPOINT_METHODS)


def check_quantization(value: str) -> str:
    """`value` if it is one of QUANTIZATIONS; else ValueError naming them."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization {value!r} is not one rein knows; choose one of {', '.join(QUANTIZATIONS)}")
    return value


def int4_group(method: str) -> int:
    """The group size of an int4 method name ("int4": the default, "int4-g64": 64)."""
    return int(method.removeprefix("int4-g")) if method.startswith("int4-g") else DEFAULT_INT4_GROUP
