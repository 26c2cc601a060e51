"""The client-error type of the wire format, and the API's context-length message: a leaf (it
imports nothing from rein). The engine raises its own errors (rein.engine.errors); how they read
here is rein.openai.engine_errors.
"""

from __future__ import annotations

from typing import Any

INVALID_REQUEST = "invalid_request_error"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A request the API refuses (HTTP 400); `param` and `code` go into OpenAI's error object."""

    type = INVALID_REQUEST

    def __init__(self, message: str, param: str | None = None, code: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's error body: {"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def context_length_message(max_model_len: int, prompt_tokens: int, max_tokens: int, chat: bool) -> str:
    """OpenAI's wording for prompt + completion longer than the context, for the API's check
    (`chat`: messages or a prompt; the engine's own refusal, rein.engine.errors.ContextLengthExceeded,
    says "in the prompt")."""
    where, what = ("in the messages", "messages") if chat else ("in your prompt", "prompt")
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} {where}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion.")


def context_length_error(max_model_len: int, prompt_tokens: int, max_tokens: int, chat: bool) -> RequestError:
    """The API's refusal of prompt + completion longer than the context."""
    return RequestError(context_length_message(max_model_len, prompt_tokens, max_tokens, chat),
                        "messages" if chat else "prompt", CONTEXT_LENGTH_EXCEEDED)
