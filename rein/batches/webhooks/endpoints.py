"""A tenant's webhook endpoint: set (which makes a new signing secret), read, remove.

The secret is Standard Webhooks' (and OpenAI's) format, `whsec_` + base64 of 32 random bytes.
It is returned once, by the call that sets it; a read shows only a hint (its last four
characters). It is kept in Postgres as is, since signing needs it (an HMAC key cannot be
stored hashed): whoever reads the `webhook_endpoints` table can sign as rein. Setting the
endpoint again replaces the URL and the secret at once (rotation): events still waiting are
signed with the new secret when they are next tried.
"""

from __future__ import annotations

import base64
import secrets
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from rein.store.tables import WebhookEndpoint

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def new_endpoint_id() -> str:
    return f"whep_{uuid.uuid4().hex}"


def secret_hint(secret: str) -> str:
    return f"{SECRET_PREFIX}…{secret[-4:]}"


def set_endpoint(session: Session, tenant: str, url: str, event_types: list[str], key_id: str) -> WebhookEndpoint:
    """Create or replace the tenant's endpoint with a new secret (flushed, not committed)."""
    row = {"id": new_endpoint_id(), "url": url, "event_types": event_types, "secret": new_secret(),
           "key_id": key_id}
    statement = (insert(WebhookEndpoint).values(tenant=tenant, **row)
                 .on_conflict_do_update(index_elements=["tenant"], set_=row | {"updated_at": func.now()})
                 .returning(WebhookEndpoint))
    return session.scalars(statement, execution_options={"populate_existing": True}).one()


def get_endpoint(session: Session, tenant: str) -> WebhookEndpoint | None:
    return session.scalars(select(WebhookEndpoint).where(WebhookEndpoint.tenant == tenant)).one_or_none()


def delete_endpoint(session: Session, tenant: str) -> str | None:
    """Remove the tenant's endpoint; its id, or None when it had none. Events still waiting fail
    at their next try (there is nowhere to send them)."""
    return session.scalar(delete(WebhookEndpoint).where(WebhookEndpoint.tenant == tenant)
                          .returning(WebhookEndpoint.id))


def endpoint_public(endpoint: WebhookEndpoint, *, with_secret: bool = False) -> dict[str, Any]:
    """OpenAI's webhook_endpoint object (openai.types.webhooks.WebhookEndpoint), with the tenant;
    `signing_secret` only when it was just set."""
    body: dict[str, Any] = {
        "id": endpoint.id, "object": "webhook_endpoint", "tenant": endpoint.tenant, "url": endpoint.url,
        "event_types": list(endpoint.event_types), "created_at": _ts(endpoint.created_at),
        "updated_at": _ts(endpoint.updated_at), "signing_secret_hint": secret_hint(endpoint.secret)}
    if with_secret:
        body["signing_secret"] = endpoint.secret
    return body


def _ts(value: datetime) -> int:
    return int(value.timestamp())
