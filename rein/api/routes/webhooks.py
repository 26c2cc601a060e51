"""A tenant's webhook endpoint, for a key with the `admin` scope (rein.batches.webhooks):

* `PUT /v1/tenants/{tenant}/webhook_endpoint` sets it (`url`, optional `event_types`) and answers
  OpenAI's webhook_endpoint object with the new `signing_secret`, shown this once; setting it
  again replaces the URL and the secret (rotation).
* `GET` reads it (a `signing_secret_hint`, never the secret); `DELETE` removes it.
* `GET .../webhook_endpoint/events` lists the tenant's latest events, each with its attempts.

The URL is checked before it is stored (rein.batches.webhooks.destinations: https, and no private,
loopback, link-local, multicast, reserved or unspecified address unless the operator allows it);
a refused one is a 400 that says why.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Depends, Query
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from rein.api.checked_route import CheckedRoute
from rein.api.deps import SessionDep, SettingsDep, require_scope
from rein.api.schemas import ErrorResponse
from rein.batches.webhooks.destinations import DestinationRefused, check_destination
from rein.batches.webhooks.endpoints import (
    delete_endpoint,
    endpoint_public,
    get_endpoint,
    set_endpoint,
)
from rein.batches.webhooks.events import ALL_EVENT_TYPES
from rein.jobs.errors import APIError
from rein.store.keys import KeyInfo
from rein.store.tables import ApiKey, WebhookAttempt, WebhookEvent

router = APIRouter(prefix="/v1/tenants/{tenant}", tags=["webhooks"], route_class=CheckedRoute)

AdminKey = Depends(require_scope("admin"))
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404)}
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
MAX_EVENTS_LISTED = 100


class WebhookEndpointRequest(BaseModel):
    """PUT /v1/tenants/{tenant}/webhook_endpoint."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Where the tenant's events are POSTed: an https URL on a public address.")
    event_types: list[str] | None = Field(None, description="The events delivered; unset: all of "
                                                            + ", ".join(ALL_EVENT_TYPES) + ".")


@router.put("/webhook_endpoint", responses=_ERRORS)
async def put_webhook_endpoint(tenant: str, body: WebhookEndpointRequest, session: SessionDep,
                               settings: SettingsDep, key: KeyInfo = AdminKey) -> dict[str, Any]:
    """Set the tenant's endpoint; the answer holds the signing secret, shown this once."""
    event_types = _event_types(body.event_types)
    try:   # (resolves the host: off the event loop)
        await run_in_threadpool(check_destination, body.url, settings)
    except DestinationRefused as exc:
        raise APIError(400, str(exc), param="url", code="invalid_webhook_url") from None
    return await run_in_threadpool(_set, session, tenant, body.url, event_types, key.key_id)


@router.get("/webhook_endpoint", responses=_ERRORS)
def get_webhook_endpoint(tenant: str, session: SessionDep, key: KeyInfo = AdminKey) -> dict[str, Any]:
    """The tenant's endpoint, with a hint of its secret (never the secret)."""
    endpoint = get_endpoint(session, _known_tenant(session, tenant))
    if endpoint is None:
        raise _no_endpoint(tenant)
    return endpoint_public(endpoint)


@router.delete("/webhook_endpoint", responses=_ERRORS)
def delete_webhook_endpoint(tenant: str, session: SessionDep, key: KeyInfo = AdminKey) -> dict[str, Any]:
    """Remove the tenant's endpoint: no more events are written, and those waiting are not sent."""
    endpoint_id = delete_endpoint(session, _known_tenant(session, tenant))
    session.commit()
    if endpoint_id is None:
        raise _no_endpoint(tenant)
    return {"id": endpoint_id, "object": "webhook_endpoint.deleted", "deleted": True}


@router.get("/webhook_endpoint/events", responses=_ERRORS)
def list_webhook_events(tenant: str, session: SessionDep, key: KeyInfo = AdminKey,
                        limit: int = Query(20, ge=1, le=MAX_EVENTS_LISTED)) -> dict[str, Any]:
    """The tenant's latest events, newest first, each with its delivery status and attempts."""
    _known_tenant(session, tenant)
    events = session.scalars(select(WebhookEvent).where(WebhookEvent.tenant == tenant)
                             .order_by(WebhookEvent.created_at.desc(), WebhookEvent.id).limit(limit)).all()
    attempts: dict[str, list[dict[str, Any]]] = {}
    if events:
        for row in session.scalars(select(WebhookAttempt).where(WebhookAttempt.event_id.in_([e.id for e in events]))
                                   .order_by(WebhookAttempt.event_id, WebhookAttempt.attempt)):
            attempts.setdefault(row.event_id, []).append({
                "attempt": row.attempt, "url": row.url, "started_at": row.started_at.timestamp(),
                "duration_ms": row.duration_ms, "status_code": row.status_code, "error": row.error})
    return {"object": "list", "data": [{
        "id": event.id, "object": "webhook_event", "type": event.type, "data": {"id": event.batch_id},
        "created_at": int(event.created_at.timestamp()), "status": event.status,
        "next_attempt_at": int(event.next_attempt_at.timestamp()) if event.status == "pending" else None,
        "delivered_at": _ts(event.delivered_at), "failed_at": _ts(event.failed_at), "last_error": event.last_error,
        "attempts": attempts.get(event.id, [])} for event in events]}


def _set(session: Session, tenant: str, url: str, event_types: list[str], key_id: str) -> dict[str, Any]:
    endpoint = set_endpoint(session, _known_tenant(session, tenant), url, event_types, key_id)
    session.commit()
    return endpoint_public(endpoint, with_secret=True)


def _event_types(requested: list[str] | None) -> list[str]:
    if requested is None:
        return list(ALL_EVENT_TYPES)
    unknown = [name for name in requested if name not in ALL_EVENT_TYPES]
    if unknown or not requested:
        raise APIError(400, f"event_types must be a non-empty list of {', '.join(ALL_EVENT_TYPES)}"
                            + (f"; unknown: {', '.join(map(repr, unknown))}" if unknown else ""),
                       param="event_types", code="invalid_value")
    return list(dict.fromkeys(requested))


def _known_tenant(session: Session, tenant: str) -> str:
    """The tenant, when some API key belongs to it (404 otherwise: most likely a typo)."""
    if not _TENANT.fullmatch(tenant) or not session.scalar(select(exists().where(ApiKey.tenant == tenant))):
        raise APIError(404, f"no API key belongs to tenant {tenant!r} (see `rein keys list`)", param="tenant",
                       code="tenant_not_found")
    return tenant


def _no_endpoint(tenant: str) -> APIError:
    return APIError(404, f"tenant {tenant!r} has no webhook endpoint; set one with PUT "
                         f"/v1/tenants/{tenant}/webhook_endpoint", code="webhook_endpoint_not_found")


def _ts(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None
