"""File expiry, as OpenAI's: when an uploaded file and a batch's output and error files expire.

An upload may carry `expires_after` (multipart fields `expires_after[anchor]` and
`expires_after[seconds]`, as the official client sends them) and a batch
`output_expires_after` (JSON `{"anchor", "seconds"}`), each with the anchor `created_at` and
between 1 hour and 30 days. Without them batch files expire after
REIN_BATCH_FILE_EXPIRY_SECONDS (30 days, OpenAI's default; 0: never). A file's `expires_at`
is its creation time plus those seconds, stored on its row; the expiry sweep
(rein.jobs.retention) deletes its bytes and row once that has passed.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import func

from rein.jobs.errors import APIError

ANCHORS = ("created_at",)
MIN_EXPIRY_SECONDS = 3600            # 1 hour
MAX_EXPIRY_SECONDS = 2_592_000       # 30 days


class ExpiresAfter(BaseModel):
    """An expiry policy: `seconds` after `anchor`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    anchor: Literal["created_at"] = Field(description="What the seconds count from: the file's creation.")
    seconds: int = Field(ge=MIN_EXPIRY_SECONDS, le=MAX_EXPIRY_SECONDS,
                         description="Seconds after the anchor, from 3600 (1 hour) to 2592000 (30 days).")


def default_expiry_seconds(settings: Any) -> int | None:
    """The expiry of a batch file sent without a policy (None: kept until deleted)."""
    return settings.batch_file_expiry_seconds or None


def expires_at_after(seconds: int | None) -> Any:
    """The `expires_at` value of a row created now (in this transaction: its created_at is
    the same now()), or None when it never expires."""
    return None if seconds is None else func.now() + timedelta(seconds=seconds)


def expires_after_from_form(fields: Mapping[str, str]) -> int | None:
    """The seconds of an upload's `expires_after[anchor]` / `expires_after[seconds]` form
    fields, or None when neither was sent (APIError 400 when they are not a valid policy)."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor not in ANCHORS:
        raise APIError(400, f"expires_after[anchor] must be 'created_at' (the only anchor), got {anchor!r}.",
                       param="expires_after.anchor", code="invalid_value")
    if seconds is None or not seconds.strip().isdigit():
        raise APIError(400, f"expires_after[seconds] must be a whole number of seconds from {MIN_EXPIRY_SECONDS} "
                            f"(1 hour) to {MAX_EXPIRY_SECONDS} (30 days), got {seconds!r}.",
                       param="expires_after.seconds", code="invalid_value")
    value = int(seconds)
    if not MIN_EXPIRY_SECONDS <= value <= MAX_EXPIRY_SECONDS:
        raise APIError(400, f"expires_after[seconds] is {value}: it must be from {MIN_EXPIRY_SECONDS} (1 hour) to "
                            f"{MAX_EXPIRY_SECONDS} (30 days). Leave expires_after out to keep the default "
                            "for batch files.", param="expires_after.seconds", code="invalid_value")
    return value
