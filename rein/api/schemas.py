"""Request and response schemas of the API: separate create and public views, never a row.

Request models for the OpenAI endpoints document the common fields and keep unknown ones
(`extra="allow"`): rein.openai_format.parse_request is the one validator of a request's
meaning (ranges, context length, unsupported fields); these models only reject wrong JSON
types early, naming the parameter. Strict mode keeps "5" from silently becoming 5.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Endpoint = Literal["/v1/chat/completions", "/v1/completions"]
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


class _OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = Field(None, description="A served model (GET /v1/models); default: the first.")
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = Field(
        None, description='{"include_usage": true} adds a last chunk with the usage.')


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[dict[str, Any]] = Field(description="[{role, content}, ...]")
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="A string or a list of token ids (one prompt per request).")
    logprobs: int | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV cache was reused from earlier requests "
                                           "(automatic prefix caching) instead of computed.")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


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


class ModelPublic(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rein"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]


# -- jobs -------------------------------------------------------------------------------------


class JobCreate(BaseModel):
    """One job: the same shape as one line of an OpenAI batch file, less custom_id/method."""

    model_config = ConfigDict(extra="forbid")

    endpoint: Endpoint
    body: dict[str, Any] = Field(description="The request body that endpoint takes.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs kept with the job.")


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
