"""How an engine's refusal reads on the wire.

The engine raises its own errors (rein.engine.errors: EngineRequestError, ContextLengthExceeded,
StructuredSpecError), each with a message a user can act on and the `param` at fault; OpenAI's
code for them is decided here, for the callers that answer with it: a batch line's error in
`rein run-batch` (request_error), a job's recorded error in the worker (job_error_code).
"""

from __future__ import annotations

from rein.engine.errors import ContextLengthExceeded, EngineRequestError
from rein.openai.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_REQUEST, RequestError

# The code of a job the engine refused for any reason but the context's length (the worker's
# job errors, and so the API's and the batch output's, have always said "invalid_request").
JOB_INVALID_REQUEST = "invalid_request"


INVALID_LORA_ADAPTER = "invalid_lora_adapter"


def job_error_code(exc: BaseException) -> str | None:
    """OpenAI's code for a job the engine refused with `exc`: context_length_exceeded,
    invalid_lora_adapter, or invalid_request for any other EngineRequestError; None when `exc` is not the engine's refusal."""
    if isinstance(exc, ContextLengthExceeded):
        return CONTEXT_LENGTH_EXCEEDED
    if isinstance(exc, EngineRequestError):
        # A LoRA adapter the engine could not load (a bad file, shapes of another base, ...).
        return INVALID_LORA_ADAPTER if exc.param == "lora_request" else JOB_INVALID_REQUEST
    return None


def request_error(exc: EngineRequestError) -> RequestError:
    """The engine's refusal as the wire's client error: its message and param, code
    context_length_exceeded or invalid_request_error."""
    code = CONTEXT_LENGTH_EXCEEDED if isinstance(exc, ContextLengthExceeded) else INVALID_REQUEST
    return RequestError(str(exc), exc.param, code)
