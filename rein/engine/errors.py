"""Errors a caller of the engine can act on; each message says what was wrong, the limit
and what to change, and `param` names the input at fault (a SamplingParams field, the prompt
or the request id).

The engine's own types: how a refusal reads on the wire (OpenAI's status, type and code) is
decided above it, in rein.openai.engine_errors.
"""

from __future__ import annotations


class EngineRequestError(ValueError):
    """A request the engine will not run, and why."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthExceeded(EngineRequestError):
    """The prompt plus max_tokens is longer than the model's context (max_model_len)."""

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion). "
            f"Please reduce the length of the prompt or completion.", param="max_tokens")
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class StructuredSpecError(EngineRequestError):
    """A structured-output spec the engine cannot enforce: past rein's caps, or refused by the
    grammar compiler (rein.engine.structured.spec.check_spec). `param` names where the spec came from."""


class CheckTimedOut(StructuredSpecError):
    """check_spec's refusal of a spec that did not compile within the validator's deadline: a
    refusal like any other, but not a verdict on the spec (on a less busy machine it may compile)."""
