"""`CheckedRoute`: the route class of every API router, which refuses unusable input first.

Before FastAPI parses or validates anything, and before any other dependency (a database
session) runs, the route authenticates an API route's key from its header alone (401 before
a byte of the body is read; rein.api.auth remembers answers for a second) and checks the
scopes the route's dependencies demand (403 naming the scope, the body still unread). A
body that may pass 64 KiB then takes one of its key's large-body slots (429 beyond
REIN_MAX_LARGE_BODIES_PER_KEY at once). Then:

- every query parameter (declared or not) and every path parameter, and the header
  parameters the route declares (Idempotency-Key, Last-Event-ID): no NUL character, no
  lone surrogate (rein.core.input_checks);
- the declared scalar query parameters, strictly as the schema types them: an integer is
  digits (pydantic alone would take "1.0" or " 1"), a number is finite, a date is
  YYYY-MM-DD (pydantic alone would take "0", a Unix time, or a datetime at midnight);
- the JSON body: its parse bounded before it starts (rein.core.json_budget: the arrays,
  objects and values it would build), then every key and value at any depth
  (rein.core.input_checks.check_json): text Postgres and the tokenizer can take, finite
  numbers, integers within 64 bits.

A failure is a 400 in OpenAI's shape whose `param` names the parameter or the JSON path
(`messages[0].content`, `body.metadata.tag`). Values within these limits then meet each
route's own validation (types, ranges, the context length) as before.

The body is parsed once: Starlette keeps the parsed JSON on the request, and FastAPI's own
parse reads it from there. The walk over it costs about a microsecond per kilobyte of text
and well under a microsecond per number (a few microseconds for a typical chat request).
"""

from __future__ import annotations

import json
import math
import re
import types
from collections.abc import Callable, Coroutine, Iterator
from datetime import date
from typing import Annotated, Any, Union, get_args, get_origin

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials

from rein.api.deps import authenticate_request, scope_missing
from rein.api.streams import StreamSlots
from rein.core.input_checks import BadInput, check_json, check_text, text_problem
from rein.core.json_budget import parse_json_within_budget
from rein.jobs.errors import APIError, unauthorized
from rein.store.keys import KeyInfo

API_PREFIX = "/v1/"
# Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones
# take one of their key's large-body slots.
INLINE_PARSE_MAX_BYTES = 64 * 1024
LARGE_BODY_RETRY_AFTER = 1
_INTEGER = re.compile(r"[+-]?\d{1,19}")
_DIGITS = re.compile(r"[+-]?\d+")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class CheckedRoute(APIRoute):
    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()
        query_kinds, headers = _declared_params(self.dependant)
        has_json_body = self.body_field is not None and not _is_form(self)
        # Decided on the route's own path template, not the request's path: behind a proxy's
        # root path (REIN_API_ROOT_PATH) the request's path is /rein/v1/..., the route's is not.
        scopes = _required_scopes(self.dependant)
        # Every /v1 route, and a route outside it that takes a scoped key (vLLM's /tokenize).
        needs_key = self.path.startswith(API_PREFIX) or bool(scopes)

        async def checked(request: Request) -> Response:
            release = None
            if needs_key:
                # The key and its scopes first, from the header alone: a client without a valid
                # key, or whose key lacks the route's scope, cannot make the API read a body.
                bearer = _bearer_token(request.headers.get("authorization"))
                if bearer is None:
                    raise unauthorized("You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
                key = await authenticate_request(request, HTTPAuthorizationCredentials(scheme="Bearer",
                                                                                       credentials=bearer))
                for scope in scopes:
                    if scope not in key.scopes:
                        raise scope_missing(scope)
                if has_json_body and _may_be_large(request):
                    release = take_large_body_slot(request, key)
            try:
                try:
                    check_params(request, query_kinds, headers)
                    if has_json_body:
                        await check_json_body(request)
                except BadInput as exc:
                    raise APIError(400, exc.message, param=exc.param, code="invalid_value") from None
                return await handler(request)
            finally:
                if release is not None:
                    release()

        return checked


def _may_be_large(request: Request) -> bool:
    """Whether the body may pass INLINE_PARSE_MAX_BYTES: its Content-Length says so, or it has
    none (a chunked body is as large as the client makes it, up to REIN_MAX_REQUEST_BYTES)."""
    length = request.headers.get("content-length")
    if length is None:
        return "chunked" in request.headers.get("transfer-encoding", "").lower()
    try:
        return int(length) > INLINE_PARSE_MAX_BYTES
    except ValueError:
        return True


def take_large_body_slot(request: Request, key: KeyInfo) -> Callable[[], None]:
    """One of the key's slots for a large body read and parsed at once in this API process
    (REIN_MAX_LARGE_BODIES_PER_KEY), or 429 `too_many_large_requests` with Retry-After. A body
    costs its bytes, and its parse a small multiple of them (rein.core.json_budget): the slots
    bound what one key's concurrent large bodies can take of the process' memory."""
    slots: StreamSlots = request.app.state.large_body_slots
    if not slots.acquire(key.key_id):
        raise APIError(429, f"This key is already sending {slots.per_key} request bodies over "
                            f"{INLINE_PARSE_MAX_BYTES // 1024} KiB to this server at once, its limit "
                            f"(REIN_MAX_LARGE_BODIES_PER_KEY). Wait for one to be answered, or retry after "
                            f"{LARGE_BODY_RETRY_AFTER} s; for many requests, upload a batch file.",
                       type="requests", code="too_many_large_requests",
                       headers={"Retry-After": str(LARGE_BODY_RETRY_AFTER)})
    return lambda: slots.release(key.key_id)


def _required_scopes(dependant: Dependant) -> tuple[str, ...]:
    """The scopes the route's dependencies demand (rein.api.deps.require_scope marks them)."""
    found = (getattr(current.call, "required_scope", None) for current in _dependants(dependant))
    return tuple(dict.fromkeys(scope for scope in found if scope is not None))


def _bearer_token(value: str | None) -> str | None:
    if value is None or value[:7].lower() != "bearer " or not value[7:].strip():
        return None
    return value[7:].strip()


def check_params(request: Request, query_kinds: dict[str, type], headers: tuple[str, ...]) -> None:
    """The query, path and declared header parameters (BadInput naming the first bad one)."""
    for name, value in request.query_params.multi_items():
        problem = text_problem(name)
        if problem is not None:   # not named in `param`: the name itself cannot be sent back
            raise BadInput(f"a query parameter name {problem}")
        check_text(value, name)
        kind = query_kinds.get(name)
        if kind is not None:
            _check_scalar(name, value, kind)
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_text(value, name)
    for name in headers:
        value = request.headers.get(name)
        if value is not None:
            check_text(value, name)


async def check_json_body(request: Request) -> None:
    """The JSON body, when there is one FastAPI will read as JSON (BadInput at the first bad value,
    or when its parse would pass the caps of rein.core.json_budget). A body past
    INLINE_PARSE_MAX_BYTES is parsed and walked in the thread pool, so the event loop (every
    other request of the process) does not wait for it."""
    raw = await request.body()
    if not raw or not _is_json(request.headers.get("content-type")):
        return
    try:
        body = (_parse_and_check(raw) if len(raw) <= INLINE_PARSE_MAX_BYTES
                else await run_in_threadpool(_parse_and_check, raw))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return   # not JSON that can be read: FastAPI reports it as a 400 in its own words
    request._json = body   # Starlette's cache of request.json(): FastAPI's own parse reuses it


def _parse_and_check(raw: bytes) -> Any:
    body = parse_json_within_budget(raw)
    check_json(body)
    return body


def _check_scalar(name: str, value: str, kind: type) -> None:
    if kind is int and not _INTEGER.fullmatch(value):
        if _DIGITS.fullmatch(value):
            raise BadInput(f"{name} is out of range: {value[:40]} has more than 19 digits", name)
        raise BadInput(f"{name} must be an integer written in digits (e.g. {name}=20), got {value[:40]!r}",
                       name)
    if kind is float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not math.isfinite(number):
            raise BadInput(f"{name} must be a finite number, got {value[:40]!r}", name)
    if kind is date:
        ok = _DATE.fullmatch(value) is not None
        if ok:
            try:
                date.fromisoformat(value)
            except ValueError:
                ok = False
        if not ok:
            raise BadInput(f"{name} must be a calendar date written YYYY-MM-DD (e.g. 2025-01-31), got "
                           f"{value[:40]!r}", name)


def _declared_params(dependant: Dependant) -> tuple[dict[str, type], tuple[str, ...]]:
    """The route's scalar query parameters by kind (int, float, date), and its header names."""
    kinds: dict[str, type] = {}
    headers: list[str] = []
    for current in _dependants(dependant):
        for field in current.query_params:
            kind = _scalar_kind(field.field_info.annotation)
            if kind is not None:
                kinds[field.alias] = kind
        headers += [field.alias for field in current.header_params]
    return kinds, tuple(dict.fromkeys(headers))


def _dependants(dependant: Dependant) -> Iterator[Dependant]:
    yield dependant
    for sub in dependant.dependencies:
        yield from _dependants(sub)


def _scalar_kind(annotation: Any) -> type | None:
    """int, float or date for `int`, `float | None`, `Annotated[date, ...]`...; None otherwise."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            return None
        annotation = members[0]
    if annotation is bool:
        return None
    return annotation if annotation in (int, float, date) else None


def _is_form(route: APIRoute) -> bool:
    from fastapi import params

    return isinstance(getattr(route.body_field, "field_info", None), params.Form)


def _is_json(content_type: str | None) -> bool:
    """As FastAPI decides: no content type, application/json or application/*+json."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
