"""Batch events: their types, the outbox row, and the body a receiver gets.

An event is written in the same transaction that moves its batch to a final status
(rein.batches.manager), so a batch that finished has its event, and a rolled-back step has none.
Only a tenant with an endpoint subscribed to the type gets a row: one INSERT ... SELECT, which
writes nothing otherwise.

The body is OpenAI's (openai.types.webhooks.Batch*WebhookEvent): `{"id": "evt_...", "object":
"event", "type": "batch.completed", "created_at": <unix seconds>, "data": {"id": "batch_..."}}`,
built from the row alone, so every retry sends the same bytes.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import literal, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rein.store.tables import Batch, WebhookEndpoint, WebhookEvent

# The batch's final status -> the event type it sends (OpenAI's batch webhook events).
EVENT_TYPES = {"completed": "batch.completed", "failed": "batch.failed", "cancelled": "batch.cancelled",
               "expired": "batch.expired"}
ALL_EVENT_TYPES = tuple(EVENT_TYPES.values())


def new_event_id() -> str:
    return f"evt_{uuid.uuid4().hex}"


def record_batch_event(session: Session, batch_id: str, status: str) -> str | None:
    """Write the event for the batch's final `status` to the outbox, in the caller's transaction,
    if the batch's tenant has an endpoint subscribed to it. The event's id, or None (no endpoint)."""
    event_type = EVENT_TYPES[status]
    event_id = new_event_id()
    subscribed = (
        select(literal(event_id), WebhookEndpoint.tenant, literal(event_type), literal(batch_id))
        .join(Batch, Batch.tenant == WebhookEndpoint.tenant)
        .where(Batch.id == batch_id, WebhookEndpoint.event_types.any(event_type)))
    written = session.execute(
        insert(WebhookEvent).from_select(["id", "tenant", "type", "batch_id"], subscribed)
        .returning(WebhookEvent.id)).first()
    return written[0] if written else None


def event_body(event_id: str, event_type: str, created_at: datetime, batch_id: str) -> dict[str, Any]:
    """The event as OpenAI sends it."""
    return {"id": event_id, "object": "event", "type": event_type, "created_at": int(created_at.timestamp()),
            "data": {"id": batch_id}}


def event_payload(event_id: str, event_type: str, created_at: datetime, batch_id: str) -> bytes:
    """The exact bytes POSTed (and signed) for the event."""
    return json.dumps(event_body(event_id, event_type, created_at, batch_id), separators=(",", ":")).encode()
