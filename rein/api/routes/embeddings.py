"""POST /v1/embeddings: OpenAI's embeddings endpoint.

The request becomes one job like any other (the same intake, limits, rate limits and
queue; rein.api.intake), whose worker runs every input through the engine
(rein.worker.embeddings); the route waits for it as the synchronous completions do
(rein.api.routes.openai) and answers with the stored body: OpenAI's `{"object": "list",
"data": [...], "model", "usage"}`, floats or base64 as `encoding_format` asks. Embeddings
are not streamed. A client that disconnects first gets its job cancelled.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rein.api.checked_route import CheckedRoute
from rein.api.deps import AsyncRedisDep, InferenceKey, SettingsDep
from rein.api.routes.openai import _complete as complete  # the synchronous endpoints' common path
from rein.api.schemas import EmbeddingList, EmbeddingRequest, ErrorResponse
from rein.openai.endpoints import EMBEDDINGS

router = APIRouter(prefix="/v1", tags=["openai"], route_class=CheckedRoute)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 429, 500, 503)}


@router.post("/embeddings", response_model=EmbeddingList, responses=_ERRORS)
async def embeddings(payload: EmbeddingRequest, request: Request, key: InferenceKey, redis: AsyncRedisDep,
                     settings: SettingsDep) -> Any:
    """Embed each input; one vector per input, in input order."""
    return await complete(EMBEDDINGS, payload.model_dump(exclude_unset=True), request, key, redis, settings)
