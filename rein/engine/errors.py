"""Errors a caller of the engine can act on; each message says what was wrong, the limit
and what to change. `code` and `param` follow OpenAI's error object."""

from __future__ import annotations


class EngineRequestError(ValueError):
    code: str = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(EngineRequestError):
    code = "context_length_exceeded"

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion.",
            param="max_tokens",
        )
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
