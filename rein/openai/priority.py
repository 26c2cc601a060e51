"""A request's `priority` and `service_tier` fields: checked, and turned into the priority its
job runs at (rein.core.priorities holds the bands and why).

* `priority` (vLLM's field): an integer, lower runs first, default 0. It orders a request
  within its class; below 0 it counts as 0 (a class's default is the best a request gets).
* `service_tier` (OpenAI's): "auto" or "default" (the endpoint's own class: interactive for
  the synchronous endpoints and POST /v1/jobs, batch for a batch line), "priority" (the
  interactive class), "flex" (the batch class: it waits behind interactive work, in the
  capacity it leaves). A batch line cannot ask for "priority": batch lines run in the batch
  class, which is how the Batch API's share of the workers is kept to what it was given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rein.core.priorities import job_priority
from rein.openai.errors import RequestError

SERVICE_TIERS = ("auto", "default", "flex", "priority")
# A 32-bit integer, as vLLM's protocol and Postgres's integer take it.
_PRIORITY_MIN, _PRIORITY_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class RequestedPriority:
    """What a body asked for: its `priority` (0 when absent) and `service_tier` (None when absent)."""

    priority: int = 0
    service_tier: str | None = None

    def job_priority(self, batch_line: bool = False) -> int:
        """The priority its job runs at: a batch line, or a "flex" request, in the batch class;
        any other request in the interactive class."""
        if batch_line and self.service_tier == "priority":
            # parse_priority refuses this for a batch line; kept here so no caller can lift one.
            raise RequestError(_BATCH_PRIORITY_TIER, "service_tier")
        return job_priority(self.priority, batch=batch_line or self.service_tier == "flex")


_BATCH_PRIORITY_TIER = ('service_tier "priority" is not available to a batch line: batch lines run at batch '
                        'priority. Leave service_tier out (or use "auto", "default" or "flex"), or send the '
                        'request to /v1/jobs or the synchronous endpoint for interactive priority')


def parse_priority(body: dict[str, Any], batch_line: bool = False) -> RequestedPriority:
    """The body's `priority` and `service_tier`, checked (RequestError 400 naming the field)."""
    priority = body.get("priority")
    if priority is None:
        priority = 0
    elif not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer (lower runs first, default 0), got "
                           f"{json.dumps(priority)[:50]}", "priority")
    elif not _PRIORITY_MIN <= priority <= _PRIORITY_MAX:
        raise RequestError(f"priority must be between {_PRIORITY_MIN} and {_PRIORITY_MAX}, got {priority}",
                           "priority")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise RequestError(f"service_tier must be one of {', '.join(repr(t) for t in SERVICE_TIERS)}, got "
                           f"{json.dumps(tier)[:50]}", "service_tier")
    if batch_line and tier == "priority":
        raise RequestError(_BATCH_PRIORITY_TIER, "service_tier")
    return RequestedPriority(priority, tier)
