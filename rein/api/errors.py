"""Every error the API returns, in OpenAI's shape: {"error": {message, type, param, code}}.

Routes raise `APIError` (or a `RequestError` from rein.openai.errors); the handlers
installed by `install_error_handlers` turn those, FastAPI's validation errors (400 naming
the offending parameter), unknown routes (404), an unreachable Postgres or Redis (503 with
Retry-After) and unexpected failures (500) into that shape, so a client parses one error
format everywhere.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rein.api.conventions import headers_for
from rein.api.request_limits import RequestTooLarge, too_large_response
from rein.engine.structured.validator import ValidatorUnavailable
from rein.jobs.errors import INVALID_REQUEST, APIError, error_body
from rein.openai.errors import RequestError
from rein.store.db import DatabaseUnavailableError

log = logging.getLogger(__name__)











def _param_of(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; ('query', 'limit') -> 'limit'."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    name = ""
    for part in parts:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            name += f".{part}" if name else str(part)
    return name or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    param = _param_of(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "missing" and param:
        message = f"'{param}' is a required property"
    elif first.get("type") == "extra_forbidden" and param:
        message = f"Unrecognized request argument supplied: {param} (this endpoint does not take it; remove it)"
    else:
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return message, param


# A store that cannot be reached right now: the request may well succeed on a retry.
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (
    OperationalError, InterfaceError, DatabaseUnavailableError, RedisConnectionError, RedisTimeoutError)
UNAVAILABLE_RETRY_AFTER = 5


def unavailable_response(exc: Exception) -> JSONResponse:
    """503 with Retry-After for a Postgres or Redis that cannot be reached (crash-only: no
    traceback for the client, one warning line in the log)."""
    redis = isinstance(exc, RedisConnectionError | RedisTimeoutError)
    what = "Redis" if redis else "The database"
    log.warning("%s unavailable: %s: %s", "Redis" if redis else "Postgres", type(exc).__name__,
                str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    return JSONResponse(
        error_body(f"{what} of this service is unavailable right now; nothing was changed by this request. "
                   f"Retry after {UNAVAILABLE_RETRY_AFTER} s.", "server_error", None,
                   "redis_unavailable" if redis else "database_unavailable"),
        status_code=503, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, INVALID_REQUEST, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
            code = "unknown_url"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return JSONResponse(error_body(message, INVALID_REQUEST, None, code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValidatorUnavailable)
    async def _no_validator(request: Request, exc: ValidatorUnavailable) -> JSONResponse:
        log.warning("structured-output validation unavailable: %s", exc)
        return JSONResponse(
            error_body(f"The structured-output constraint could not be checked right now ({exc}); nothing "
                       f"was accepted. Retry after {UNAVAILABLE_RETRY_AFTER} s.", "server_error", None,
                       "validator_unavailable"),
            status_code=503, headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER)})

    # Safety nets for input that reached a parser without a bound: JSON nested past Python's
    # recursion limit, a codec named by the request that is unknown or not a text encoding
    # (exactly LookupError: its subclasses KeyError and IndexError are rein's own bugs, 500s).
    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        log.warning("%s %s: input nested too deeply to read (RecursionError)", request.method, request.url.path)
        return JSONResponse(error_body("The request holds a value nested too deeply to read; flatten it.",
                                       INVALID_REQUEST, None, "invalid_value"), status_code=400)

    @app.exception_handler(LookupError)
    async def _unknown_codec(request: Request, exc: LookupError) -> JSONResponse:
        if type(exc) is not LookupError:
            raise exc   # KeyError, IndexError: on to the 500 handler below
        log.warning("%s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(error_body(f"The request names an encoding rein cannot use ({exc}); send utf-8.",
                                       INVALID_REQUEST, None, "invalid_value"), status_code=400)

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
        return too_large_response(exc.limit)

    async def _unavailable(request: Request, exc: Exception) -> JSONResponse:
        return unavailable_response(exc)

    for error_class in UNAVAILABLE_ERRORS:
        app.add_exception_handler(error_class, _unavailable)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        # Starlette answers this outside every middleware: the conventions' headers are added here.
        return JSONResponse(error_body("The server had an error while processing your request.",
                                       "server_error", None, "internal_error"), status_code=500,
                            headers=headers_for(request.scope, 500))
