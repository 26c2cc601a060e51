"""The most a request body may cost the API: `RequestLimits`, a plain ASGI middleware
outermost of rein's, so it acts before routing and before anything reads the body.

A body larger than REIN_MAX_REQUEST_BYTES is refused with 413: at once when its
Content-Length says so, and otherwise (a chunked body) as soon as the bytes received pass
the limit — the body is counted as it arrives, never held whole first. File uploads
(POST /v1/files) are left to their route, which streams them to storage against
REIN_MAX_FILE_BYTES and the tenant's quota. (A request without a key is refused before its
body is read by the route class, rein.api.checked_route.)
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rein.jobs.errors import error_body

UPLOAD_PATH = "/v1/files"


class RequestTooLarge(Exception):
    """Raised from `receive` when a body passes the limit; the API's handler answers 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


def too_large_response(limit: int) -> JSONResponse:
    return JSONResponse(error_body(
        f"The request body is larger than this deployment's limit of {limit} bytes (REIN_MAX_REQUEST_BYTES). "
        f"Send a smaller request; for many requests, upload a batch file (POST /v1/files, POST /v1/batches).",
        "invalid_request_error", None, "request_too_large"), status_code=413)


class RequestLimits:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.lower(), value)
        if path == UPLOAD_PATH and scope.get("method") == "POST":
            await self.app(scope, receive, send)
            return
        length = _content_length(headers.get(b"content-length"))
        if length is not None and length > self.max_bytes:
            await too_large_response(self.max_bytes)(scope, receive, send)
            return
        await self.app(scope, _counted(receive, self.max_bytes), send)


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: without the root path a proxy serves the API
    under (REIN_API_ROOT_PATH), which ASGI servers leave at the front of `path`."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


def _content_length(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _counted(receive: Receive, limit: int) -> Receive:
    received = 0

    async def counting() -> Message:
        nonlocal received
        message: dict[str, Any] = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise RequestTooLarge(limit)
        return message

    return counting
