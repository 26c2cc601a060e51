"""Errors a caller of the engine can act on; each message says what was wrong, the limit
and what to change. `code` and `param` follow OpenAI's error object."""

from __future__ import annotations

from rein.openai.errors import CONTEXT_LENGTH_EXCEEDED, context_length_message


class EngineRequestError(ValueError):
    code: str = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(EngineRequestError):
    code = CONTEXT_LENGTH_EXCEEDED

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(context_length_message(max_model_len, prompt_tokens, max_tokens), param="max_tokens")
        self.max_model_len = max_model_len
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
