"""Request and response schemas of the API: separate create and public views, never a row.

Request models for the OpenAI endpoints document the common fields and keep unknown ones
(`extra="allow"`): rein.openai.request.parse_request is the one validator of a request's
meaning (ranges, context length, unsupported fields); these models only reject wrong JSON
types early, naming the parameter. Strict mode keeps "5" from silently becoming 5. The
ranges parse_request enforces are written into the OpenAPI schema (`_documented`) but not
checked here, so its messages stay the ones users see; the fuzz test
(tests/e2e/test_fuzz.py) holds the two to each other: a request outside a documented range
must be refused.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rein.engine.sampling_params import MAX_N
from rein.jobs.fields import MAX_METADATA_PAIRS, Endpoint
from rein.openai.embeddings import ENCODING_FORMATS, MAX_INPUTS
from rein.openai.limits import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)
from rein.openai.tool_request import MAX_TOOLS

JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


# -- errors -----------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used by every error response."""

    error: ErrorDetail


# -- OpenAI requests --------------------------------------------------------------------------


def _documented(**schema: Any) -> Any:
    """A field whose OpenAPI schema also states `schema` (a range parse_request enforces)."""
    return Field(None, json_schema_extra=schema)


def _replaced(schema: dict[str, Any], description: str) -> Any:
    """A required field documented exactly as `schema` (a shape parse_request checks itself)."""
    def replace(field_schema: dict[str, Any]) -> None:
        field_schema.clear()
        field_schema.update(schema, description=description)

    return Field(description=description, json_schema_extra=replace)


_TOKEN_ID = {"type": "integer", "minimum": 0}
_TEXT = {"type": "string"}
_NONEMPTY_TEXT = {"type": "string", "minLength": 1}
_STOP = {"type": "string", "minLength": 1}


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="A served model (GET /v1/models); default: the first.")
    max_tokens: int | None = _documented(minimum=1)
    max_completion_tokens: int | None = _documented(minimum=1)
    # The ranges of rein.engine.sampling_params.SamplingParams.
    temperature: float | None = _documented(minimum=0, maximum=2)
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    top_k: int | None = _documented(minimum=-1, description="0 or -1: off")
    min_p: float | None = _documented(minimum=0, maximum=1)
    presence_penalty: float | None = _documented(minimum=-2, maximum=2)
    frequency_penalty: float | None = _documented(minimum=-2, maximum=2)
    repetition_penalty: float | None = _documented(minimum=MIN_REPETITION_PENALTY, maximum=MAX_REPETITION_PENALTY)
    # int64 (rein.core.input_checks): a format, since OpenAPI numbers would round the exact bounds.
    seed: int | None = _documented(format="int64")
    stop: str | list[str] | None = Field(None, json_schema_extra=lambda schema: schema.update(anyOf=[
        _TEXT, {"type": "array", "items": _STOP, "maxItems": 4}, {"type": "null"}]))   # "": none
    stop_token_ids: list[int] | None = Field(None, json_schema_extra=lambda schema: schema.update(anyOf=[
        {"type": "array", "items": _TOKEN_ID}, {"type": "null"}]))
    ignore_eos: bool | None = None
    n: int | None = _documented(minimum=1, maximum=MAX_N, description="Choices to generate (they share one prefill).")
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(
        None, description='{"include_usage": true} adds a last chunk with the usage.',
        json_schema_extra=lambda schema: schema.update(anyOf=[
            {"type": "object", "properties": {"include_usage": {"type": ["boolean", "null"]}}},
            {"type": "null"}]))


_CONTENT = [_TEXT, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _TEXT}}}]
# Content is required but for an assistant's message (null or missing: empty).
_FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}
# An assistant's earlier tool calls (rein.openai.tool_request.template_message_fields); arguments: a JSON object.
_TOOL_CALLS = {"anyOf": [{"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["function"],
    "properties": {"id": _TEXT, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": _NONEMPTY_TEXT, "arguments": {"type": ["string", "object"]}}}}}}]}
_MESSAGE = {"anyOf": [
    {"type": "object", "required": ["role", "content"],
     "properties": {"role": {"enum": ["system", "developer", "user"]}, "content": {"anyOf": _CONTENT}}},
    {"type": "object", "required": ["role", "content", "tool_call_id"],
     "properties": {"role": {"const": "tool"}, "content": {"anyOf": _CONTENT}, "tool_call_id": _TEXT}},
    {"type": "object", "required": ["role"],
     "properties": {"role": {"const": "assistant"}, "content": {"anyOf": [*_CONTENT, {"type": "null"}]},
                    "tool_calls": _TOOL_CALLS}},
]}
_TOOL = {"type": "object", "required": ["type", "function"], "additionalProperties": False, "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
        "name": _FUNCTION_NAME, "description": {"type": ["string", "null"]},
        "parameters": {"anyOf": [{"type": "object"}, {"type": "null"}],
                       "description": "A JSON Schema of an object: the function's arguments."},
        "strict": {"type": ["boolean", "null"]}}}}}
_TOOL_CHOICE = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": _TEXT}}}},
    {"type": "null"}]}


def _schema(schema: dict[str, Any], description: str) -> Any:
    """An optional field documented exactly as `schema` (a shape parse_request checks itself)."""
    def replace(field_schema: dict[str, Any]) -> None:
        field_schema.clear()
        field_schema.update(schema, description=description)

    return Field(None, description=description, json_schema_extra=replace)


class ChatCompletionRequest(_OpenAIRequest):
    # top_logprobs needs logprobs: true (parse_request refuses it otherwise).
    model_config = ConfigDict(json_schema_extra={
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})

    messages: list[dict[str, Any]] = _replaced(
        {"type": "array", "items": _MESSAGE, "minItems": 1}, "[{role, content}, ...]")
    logprobs: bool | None = None
    top_logprobs: int | None = _documented(minimum=0, maximum=MAX_CHAT_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = _schema(
        {"anyOf": [{"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS}, {"type": "null"}]},
        "Functions the model may call (rein.openai.tools).")
    tool_choice: str | dict[str, Any] | None = _schema(
        _TOOL_CHOICE, 'none | auto (default with tools) | required | {"type": "function", "function": {"name"}}.')
    parallel_tool_calls: bool | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's Responses request, the stateless subset rein serves (rein.openai.responses
    checks and translates every field; unknown ones are refused there)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="A served model (GET /v1/models); default: the first.")
    input: str | list[dict[str, Any]] = Field(
        description="A string, or items: messages, function_call and function_call_output items.")
    instructions: str | None = Field(None, description="A system message ahead of the input.")
    max_output_tokens: int | None = _documented(minimum=1)
    temperature: float | None = _documented(minimum=0, maximum=2)
    top_p: float | None = _documented(exclusiveMinimum=0, maximum=1)
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                        '"json_schema", "name", "schema", "strict"}}')
    tools: list[dict[str, Any]] | None = Field(
        None, description='Function tools: {"type": "function", "name", "description", "parameters", "strict"}.')
    tool_choice: str | dict[str, Any] | None = Field(
        None, description='none | auto | required | {"type": "function", "name"}.')
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = Field(None, description="{effort, summary}: see docs/api.md.")
    metadata: dict[str, str] | None = Field(None, description="Echoed back in the response.")
    store: bool | None = Field(None, description="Accepted either way; rein offers no stored-response retrieval.")
    stream: bool | None = False


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = _replaced(
        {"anyOf": [_NONEMPTY_TEXT, {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                   {"type": "array", "items": _NONEMPTY_TEXT, "minItems": 1, "maxItems": 1},
                   {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                    "minItems": 1, "maxItems": 1}]},
        "A string or a list of token ids (one prompt per request).")
    logprobs: int | None = _documented(minimum=0, maximum=MAX_COMPLETION_LOGPROBS)


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request (rein.openai.embeddings.parse_embeddings_request checks its
    meaning: lengths, the context, token ids, what `dimensions` the model allows)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="A served model (GET /v1/models); default: the first.")
    input: str | list[str] | list[int] | list[list[int]] = _replaced(
        {"anyOf": [_NONEMPTY_TEXT,
                   {"type": "array", "items": _NONEMPTY_TEXT, "minItems": 1, "maxItems": MAX_INPUTS},
                   {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                   {"type": "array", "items": {"type": "array", "items": _TOKEN_ID, "minItems": 1},
                    "minItems": 1, "maxItems": MAX_INPUTS}]},
        f"A string, a list of up to {MAX_INPUTS} strings, a list of token ids, or a list of lists of token "
        "ids; each input within the model's context, at most 300,000 tokens in all.")
    dimensions: int | None = _documented(
        minimum=1, description="Fewer dimensions (Matryoshka); only for a model that declares support.")
    encoding_format: str | None = Field(None, json_schema_extra=lambda schema: schema.update(anyOf=[
        {"enum": list(ENCODING_FORMATS)}, {"type": "null"}]), description="float (default) or base64.")
    user: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field(description="The arguments, a JSON object as a string.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(BaseModel):
    role: str
    content: str | None = Field(description="null when the answer is only tool calls (or only thinking).")
    reasoning_content: str | None = Field(None, description="A reasoning model's thinking, when the model has a "
                                          "reasoning parser (absent otherwise; null when there was none).")
    reasoning: str | None = Field(None, description="The same as reasoning_content (newer vLLM's name).")
    tool_calls: list[ToolCall] | None = Field(None, description="The calls of a request with tools "
                                              "(absent otherwise).")


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV cache was reused from earlier requests "
                                           "(automatic prefix caching) instead of computed.")


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Tokens of the thinking, up to and including </think>.")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="Chat answers of a model with a reasoning parser (absent otherwise).")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str = Field(description="Floats, or base64 of little-endian float32 bytes.")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rein"
    max_model_len: int
    root: str | None = None
    """Where it comes from: a model's source, a LoRA adapter's path (as vLLM's /v1/models)."""
    parent: str | None = None
    """A LoRA adapter's base model; None for a model."""


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter, vLLM's body, with rein's base_model_name."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(description="The name requests pass as `model` to run under the adapter.")
    lora_path: str = Field(description="The adapter, where every worker can read it: a PEFT directory "
                                       "(adapter_config.json + adapter_model.safetensors) or a GGUF LoRA file.")
    base_model_name: str | None = Field(None, description="The served model it runs over; unset: the one its "
                                                          "adapter_config.json names, else the default model. "
                                                          "Given, it also skips the check that the adapter "
                                                          "was trained on that model.")
    load_inplace: bool = Field(False, description="Replace an adapter already registered under lora_name.")


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter, vLLM's body."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = Field(None, description="Accepted for vLLM's clients; the name decides.")


class TokenizeRequest(BaseModel):
    """POST /tokenize, vLLM's body: a prompt, or chat messages (with the chat fields that shape
    the template's output)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="A served model or LoRA adapter; default: the first model.")
    prompt: str | None = Field(None, description="Text, tokenized as /v1/completions does.")
    messages: list[dict[str, Any]] | None = Field(None, description="A chat, through the model's chat template "
                                                                    "with the generation prompt, as "
                                                                    "/v1/chat/completions builds it.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = Field(True, description="With prompt: the tokenizer's special tokens (BOS).")
    return_token_strs: bool = Field(False, description="Also the tokens as the vocabulary spells them.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    """POST /detokenize, vLLM's body."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


# -- jobs -------------------------------------------------------------------------------------


class JobCreate(BaseModel):
    """One job: the same shape as one line of an OpenAI batch file, less custom_id/method."""

    model_config = ConfigDict(extra="forbid")

    endpoint: Endpoint
    body: dict[str, Any] = _replaced(
        {"anyOf": [{"$ref": "#/components/schemas/ChatCompletionRequest"},
                   {"$ref": "#/components/schemas/CompletionRequest"},
                   {"$ref": "#/components/schemas/EmbeddingRequest"},
                   {"$ref": "#/components/schemas/ResponsesRequest"}]},
        "The request body that endpoint takes.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs kept with the job.",
                                            json_schema_extra={"maxProperties": MAX_METADATA_PAIRS})


class JobCreated(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus


class JobTimings(BaseModel):
    queued_at: datetime
    started_at: datetime | None
    first_token_at: datetime | None
    finished_at: datetime | None
    queue_seconds: float | None = Field(description="started_at - queued_at")
    time_to_first_token_seconds: float | None = Field(description="first_token_at - queued_at")
    total_seconds: float | None = Field(description="finished_at - queued_at")


class JobUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    reasoning_tokens: int = Field(0, description="Completion tokens of a reasoning model's thinking (a chat "
                                                 "job of a model with a reasoning parser; else 0).")


class JobResponse(BaseModel):
    status_code: int
    body: dict[str, Any] = Field(description="Exactly what the synchronous endpoint returns.")


class JobError(BaseModel):
    message: str
    type: str | None = None
    code: str | None = None


class JobPublic(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    endpoint: str
    created_at: datetime
    metadata: dict[str, Any]
    batch_id: str | None = Field(None, description="The batch the job is a line of, if any.")
    custom_id: str | None = Field(None, description="That batch line's custom_id.")
    prompt_tokens: int
    cancel_requested_at: datetime | None
    timings: JobTimings
    usage: JobUsage | None
    response: JobResponse | None = Field(None, description="When the job has succeeded.")
    error: JobError | None = Field(None, description="When the job has failed.")


class JobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobPublic]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- usage and health -------------------------------------------------------------------------


class UsageBucket(BaseModel):
    date: str = Field(description="UTC day, YYYY-MM-DD")
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class UsageReport(BaseModel):
    object: Literal["list"] = "list"
    tenant: str
    data: list[UsageBucket]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ready", "not_ready"]
    checks: dict[str, str]
