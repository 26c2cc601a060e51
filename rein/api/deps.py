"""FastAPI dependencies as `Annotated` aliases, so a route's signature says what it needs.

They are `async def` unless they block: FastAPI runs a plain `def` dependency in its
thread pool, and on the intake path those thread hops cost more than the work itself.

`CurrentKey` authenticates the bearer key (401 when missing, malformed, unknown or
revoked); `require_scope("batch")` also demands a scope (403 naming it). Authentication
(rein.api.auth) uses its own short session, so a long-lived response (SSE) holds no
database connection, and remembers a verified key for a second.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis import Redis
from redis.asyncio import Redis as AsyncRedis
from sqlalchemy.orm import Session, sessionmaker

from rein.api.auth import KeyCache, authenticate_and_remember, key_digest
from rein.core.settings import Settings
from rein.jobs.errors import APIError, unauthorized
from rein.store.keys import InvalidKeyError, KeyInfo

if TYPE_CHECKING:
    from rein.jobs.registry import ModelRegistry

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer rein_<id>_<secret>`")


async def get_settings_dep(request: Request) -> Settings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


async def get_redis(request: Request) -> Redis:
    return request.app.state.redis


async def get_async_redis(request: Request) -> AsyncRedis:
    return request.app.state.async_redis


async def get_registry(request: Request) -> ModelRegistry:
    return request.app.state.registry


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
SessionDep = Annotated[Session, Depends(get_session)]
RedisDep = Annotated[Redis, Depends(get_redis)]
AsyncRedisDep = Annotated[AsyncRedis, Depends(get_async_redis)]
RegistryDep = Annotated["ModelRegistry", Depends(get_registry)]


async def authenticate_request(request: Request, credentials: HTTPAuthorizationCredentials | None) -> KeyInfo:
    """The key of the request's bearer credentials (401 when missing, unknown or revoked).
    The route checked it before reading the body (rein.api.checked_route); this finds it there."""
    known = getattr(request.state, "key_info", None)
    if known is not None:
        return known
    if credentials is None or not credentials.credentials:
        raise unauthorized("You didn't provide an API key. Send it as `Authorization: Bearer <key>`.")
    cache: KeyCache = request.app.state.key_cache
    digest = key_digest(credentials.credentials)
    info = cache.get(digest)   # on the event loop: a remembered key costs no thread hop
    if info is not None:
        request.state.key_info = info
        return info
    refused = cache.refusal(digest)
    if refused is not None:
        raise unauthorized(f"Incorrect API key provided: {refused}")
    try:
        info = await run_in_threadpool(authenticate_and_remember, request.app.state.sessions, cache, digest,
                                       credentials.credentials)
    except InvalidKeyError as exc:
        raise unauthorized(f"Incorrect API key provided: {exc}") from None
    request.state.key_info = info
    return info


BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def current_key(request: Request, credentials: BearerDep) -> KeyInfo:
    return await authenticate_request(request, credentials)


CurrentKey = Annotated[KeyInfo, Depends(current_key)]


def scope_missing(scope: str) -> APIError:
    """The 403 for a key without `scope`, naming it."""
    return APIError(403, f"API scope is not declared: {scope}", type="permission_error",
                    code="insufficient_scope")


def require_scope(scope: str) -> Callable[..., Awaitable[KeyInfo]]:
    """A dependency: the current key, which must hold `scope` (403 naming it otherwise).

    The route class finds the scope on the dependency (`required_scope`) and checks it from
    the header, before the body is read (rein.api.checked_route); this check stays for a
    route served without that class. It authenticates itself rather than depending on
    `current_key`: every level of nested dependencies costs FastAPI a resolution on each
    request, and these guard the intake path.
    """

    async def check(request: Request, credentials: BearerDep) -> KeyInfo:
        key = await authenticate_request(request, credentials)
        if scope not in key.scopes:
            raise scope_missing(scope)
        return key

    check.__name__ = f"require_{scope}_scope"
    check.required_scope = scope   # type: ignore[attr-defined]
    return check


InferenceKey = Annotated[KeyInfo, Depends(require_scope("inference"))]
UsageKey = Annotated[KeyInfo, Depends(require_scope("usage"))]
