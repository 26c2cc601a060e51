"""GET /v1/usage: the caller's (tenant's) tokens, by model and UTC day."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import func, select

from rein.api.checked_route import CheckedRoute
from rein.api.deps import SessionDep, UsageKey
from rein.api.schemas import ErrorResponse, UsageBucket, UsageReport
from rein.store.tables import Usage

router = APIRouter(prefix="/v1", tags=["usage"], route_class=CheckedRoute)


@router.get("/usage", response_model=UsageReport,
            responses={code: {"model": ErrorResponse} for code in (400, 401, 403)})
def get_usage(session: SessionDep, key: UsageKey,
              start: Annotated[date | None, Query(description="First UTC day (YYYY-MM-DD)")] = None,
              end: Annotated[date | None, Query(description="Last UTC day, inclusive")] = None,
              ) -> UsageReport:
    """Requests and tokens of the caller's tenant per model and day, oldest first."""
    day = func.date(func.timezone("UTC", Usage.created_at))
    query = (select(day.label("day"), Usage.model, func.count().label("requests"),
                    func.sum(Usage.prompt_tokens).label("prompt"),
                    func.sum(Usage.completion_tokens).label("completion"),
                    func.sum(Usage.cached_tokens).label("cached"))
             .where(Usage.tenant == key.tenant).group_by(day, Usage.model).order_by(day, Usage.model))
    if start is not None:
        query = query.where(Usage.created_at >= datetime.combine(start, time(), UTC))
    if end is not None and end < date.max:   # the last representable day has no day after it
        query = query.where(Usage.created_at < datetime.combine(end + timedelta(days=1), time(), UTC))
    rows = session.execute(query).all()
    return UsageReport(tenant=key.tenant, data=[
        UsageBucket(date=row.day.isoformat(), model=row.model, requests=row.requests,
                    prompt_tokens=int(row.prompt), completion_tokens=int(row.completion),
                    cached_tokens=int(row.cached), total_tokens=int(row.prompt) + int(row.completion))
        for row in rows])
