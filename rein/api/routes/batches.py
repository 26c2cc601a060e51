"""The OpenAI Batches API (placeholder router until the batch routes land)."""

from fastapi import APIRouter

router = APIRouter(prefix="/v1/batches", tags=["batches"])
