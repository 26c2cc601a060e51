"""The `--model-impl` names, defined once and torch-free: the flags and `rein.LLM`'s keyword
(rein.engine.options) list them, and EngineConfig and rein.model.implementation.spec_for check
a value with `check_model_impl`. rein: rein's native model code only; transformers: the model's
own transformers code with rein's paged attention (the Transformers backend); auto: native code
where rein has it, else transformers.
"""

from __future__ import annotations

MODEL_IMPLS = ("auto", "rein", "transformers")


def check_model_impl(value: str) -> str:
    """`value` if it is one of MODEL_IMPLS; else ValueError naming them."""
    if value not in MODEL_IMPLS:
        raise ValueError(f"model_impl {value!r} is not supported: use one of {', '.join(MODEL_IMPLS)}")
    return value
