"""GET /healthz and its alias /health (the process answers) and GET /readyz (Redis, Postgres, migrations)."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rein.api.checked_route import CheckedRoute
from rein.api.schemas import Health, Readiness
from rein.store.db import DatabaseNotMigratedError, check_migrations_current

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"], route_class=CheckedRoute)


@router.get("/healthz", response_model=Health)
@router.get("/health", response_model=Health, include_in_schema=False)   # vLLM's name
def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(request: Request) -> JSONResponse:
    """200 when Redis answers and Postgres is reachable at the current migration; 503 otherwise."""
    state = request.app.state
    checks: dict[str, str] = {}
    # Open to anyone (probes send no key), so it says what is wrong, never where the servers
    # are or how they answered: that goes to the log.
    try:
        state.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # any Redis failure means not ready
        log.warning("readyz: Redis unavailable: %s", exc)
        checks["redis"] = "unavailable"
    try:
        check_migrations_current(state.sessions.kw["bind"])
        checks["postgres"] = "ok"
    except DatabaseNotMigratedError as exc:
        log.warning("readyz: %s", exc)
        checks["postgres"] = "not migrated: run `rein migrate`"
    except Exception as exc:
        log.warning("readyz: Postgres unavailable: %s", exc)
        checks["postgres"] = "unavailable"
    ready = all(value.startswith("ok") for value in checks.values())
    body = Readiness(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)
