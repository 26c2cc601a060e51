"""HTTP conventions OpenAI's and vLLM's clients rely on, added to every response by one
pure ASGI middleware (`HTTPConventions`, outermost but for CORS):

* `x-request-id`: the job id on a response that created or named a job (the OpenAI
  endpoints and POST /v1/jobs, errors after the job was created included: a route calls
  `set_request_id`); on any other response the client's own `x-request-id` echoed when it
  sent a usable one (as vLLM does, so a proxy's id follows the request), else a fresh
  `req_<hex>`.
* `x-should-retry`: OpenAI's SDKs read it before their status rules (which retry 408, 409,
  429 and 5xx). A route may set it (`set_response_headers`, or an APIError's headers);
  otherwise it follows the status: `true` on 408, 429, 502, 503 and 504, `false` on the
  other 4xx (a retry of a 409 — a cancelled job — would submit the job again), nothing on
  2xx/3xx and on 500 (the SDK's own rule: retry).
* Headers a route adds for the response it has not built yet (`set_response_headers`):
  the OpenAI rate-limit headers (rein.jobs.ratelimit.RateLimitState.headers).

CORS is Starlette's CORSMiddleware (`cors_options`), off unless REIN_ALLOWED_ORIGINS names
origins.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID = "x-request-id"
SHOULD_RETRY = "x-should-retry"
_SCOPE_KEY = "rein.response"     # scope entry: {"request_id": str, "headers": dict}
# A client's x-request-id is echoed only when it is a plain token of reasonable length.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
_RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
# Headers a browser page may read on a cross-origin response (CORS).
EXPOSED_HEADERS = ("x-request-id", "x-should-retry", "retry-after", "x-ratelimit-limit-requests",
                   "x-ratelimit-limit-tokens", "x-ratelimit-remaining-requests",
                   "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


def _state(scope: Scope) -> dict[str, Any]:
    state = scope.get(_SCOPE_KEY)
    if state is None:   # outside the middleware (a test mounting a router alone): harmless
        state = scope[_SCOPE_KEY] = {"request_id": new_request_id(), "headers": {}}
    return state


def set_request_id(request: HTTPConnection, request_id: str) -> None:
    """The response's x-request-id: the job the request created or named."""
    _state(request.scope)["request_id"] = request_id


def request_id_of(scope: Scope) -> str:
    return _state(scope)["request_id"]


def set_response_headers(request: HTTPConnection, headers: dict[str, str]) -> None:
    """Headers for the response to this request, whatever route or error handler builds it
    (one the response sets itself wins)."""
    _state(request.scope)["headers"].update(headers)


def should_retry(status: int) -> str | None:
    """The default x-should-retry for a status: 'true', 'false', or None (no header)."""
    if status in _RETRY_STATUSES:
        return "true"
    if 400 <= status < 500:
        return "false"
    return None


def convention_headers(scope: Scope, status: int, present: set[str]) -> list[tuple[bytes, bytes]]:
    """The raw headers to add to a response of `status` that already has the `present` ones
    (lowercase names)."""
    state = _state(scope)
    added: list[tuple[bytes, bytes]] = []
    if REQUEST_ID not in present:
        added.append((REQUEST_ID.encode(), state["request_id"].encode("latin-1")))
    for name, value in state["headers"].items():
        if name.lower() not in present:
            added.append((name.lower().encode(), str(value).encode("latin-1")))
    if SHOULD_RETRY not in present and SHOULD_RETRY not in state["headers"]:
        retry = should_retry(status)
        if retry is not None:
            added.append((SHOULD_RETRY.encode(), retry.encode()))
    return added


def headers_for(scope: Scope, status: int, headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` plus the conventions' own, for a response built outside the middleware's
    reach (Starlette's outermost 500 handler)."""
    merged = dict(headers or {})
    present = {name.lower() for name in merged}
    for name, value in convention_headers(scope, status, present):
        merged[name.decode()] = value.decode("latin-1")
    return merged


class HTTPConventions:
    """Pure ASGI middleware: x-request-id, x-should-retry and the headers routes asked for."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_id = None
        for name, value in scope.get("headers", ()):
            if name.lower() == b"x-request-id":
                text = value.decode("latin-1").strip()
                client_id = text if _CLIENT_ID.fullmatch(text) else None
                break
        scope[_SCOPE_KEY] = {"request_id": client_id or new_request_id(), "headers": {}}

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.decode("latin-1").lower() for name, _ in headers}
                message = {**message, "headers": headers + convention_headers(scope, message["status"], present)}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def cors_options(origins: tuple[str, ...]) -> dict[str, Any]:
    """CORSMiddleware's options for REIN_ALLOWED_ORIGINS: bearer keys, never cookies
    (allow_credentials off), any request header (the SDKs send their own), rein's headers
    readable by the page."""
    return {"allow_origins": list(origins), "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"],
            "allow_headers": ["*"], "allow_credentials": False, "expose_headers": list(EXPOSED_HEADERS),
            "max_age": 600}
