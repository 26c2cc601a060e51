"""GET /healthz (the process answers) and GET /readyz (Redis, Postgres, migrations)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rein.api.checked_route import CheckedRoute
from rein.api.schemas import Health, Readiness
from rein.core.db import StoreError, check_migrations_current

router = APIRouter(tags=["health"], route_class=CheckedRoute)


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
def readyz(request: Request) -> JSONResponse:
    """200 when Redis answers and Postgres is reachable at the current migration; 503 otherwise."""
    state = request.app.state
    checks: dict[str, str] = {}
    try:
        state.redis.ping()
        checks["redis"] = "ok"
    except Exception as exc:  # any Redis failure means not ready
        checks["redis"] = f"unavailable: {exc}"
    try:
        checks["postgres"] = f"ok (revision {check_migrations_current(state.sessions.kw['bind'])})"
    except StoreError as exc:
        checks["postgres"] = str(exc)
    except Exception as exc:
        checks["postgres"] = f"unavailable: {exc}"
    ready = all(value.startswith("ok") for value in checks.values())
    body = Readiness(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)
