"""Request and response schemas of the Files and Batches API, in OpenAI's shapes.

Timestamps are Unix seconds, as OpenAI's. These are the public views; rows never leave the
API as they are (see rein.batches.repository for the mapping).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rein.batches.expiry import ExpiresAfter
from rein.jobs.fields import MAX_METADATA_PAIRS, Endpoint

# Checked by POST /v1/batches (rein.api.routes.batches), as OpenAI limits them.
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512

BatchStatus = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired",
                      "cancelling", "cancelled"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output", "vision"]
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class BatchCreate(BaseModel):
    # An unknown field is a 400 naming it, as on every other endpoint.
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str = Field(description="An uploaded file (purpose batch) of request lines.")
    endpoint: Endpoint = Field(description="The url every line must name.")
    completion_window: Literal["24h"] = Field(
        description='"24h" (the deployment\'s REIN_BATCH_COMPLETION_WINDOW_SECONDS).')
    metadata: dict[str, str] | None = Field(
        None, description="Up to 16 string pairs kept with the batch.",
        json_schema_extra={"maxProperties": MAX_METADATA_PAIRS,
                           "propertyNames": {"maxLength": MAX_METADATA_KEY_LEN},
                           "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_LEN}})
    output_expires_after: ExpiresAfter | None = Field(
        None, description="When the batch's output and error files expire: `seconds` (3600 to 2592000) after "
                          "they are created. Unset: REIN_BATCH_FILE_EXPIRY_SECONDS (30 days by default).")


class BatchErrorItem(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorItem]


class BatchRequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: BatchRequestCounts
    usage: BatchUsage
    metadata: dict[str, Any] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
