"""The FastAPI application: `create_app(settings)`.

At startup (the lifespan) the app refuses an unmigrated database with the migration
check's message (`rein migrate` fixes it), loads each served model's tokenizer once,
opens its Redis clients (sync for intake, asyncio for streams) and the Celery producer, and
starts its background threads: the intake's group committer, the batch manager, a
reaper (rein.jobs.reaper), the retention loop (rein.jobs.retention) and the webhooks' deliverer
(rein.batches.webhooks.delivery).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.middleware.cors import CORSMiddleware
from sqlalchemy.orm import sessionmaker

from rein.api.auth import KeyCache
from rein.api.conventions import HTTPConventions, cors_options
from rein.api.errors import install_error_handlers
from rein.api.intake import JobIntake
from rein.api.metrics import APIMetrics, MetricsMiddleware
from rein.api.metrics import router as metrics_router
from rein.api.request_limits import RequestLimits
from rein.api.routes import (
    batches,
    embeddings,
    files,
    health,
    jobs,
    lora,
    openai,
    tokenize,
    usage,
    webhooks,
)
from rein.api.streams import STREAM_SOCKET_TIMEOUT, StreamSlots
from rein.batches.manager import BatchManager
from rein.batches.webhooks.delivery import WebhookDeliverer
from rein.core.settings import Settings, get_settings
from rein.jobs.queues import make_celery
from rein.jobs.ratelimit import RateLimiter
from rein.jobs.reaper import Reaper
from rein.jobs.registry import ModelRegistry
from rein.jobs.retention import RetentionLoop
from rein.store.db import check_migrations_current, make_engine
from rein.store.filestore import filestore_for
from rein.store.redis_client import async_redis_client, redis_client
from rein.store.redis_keys import RedisKeys
from rein.store.s3 import check_files_url

log = logging.getLogger(__name__)

# Connections of the streams' pool beyond REIN_MAX_EVENT_STREAMS (for the other async uses),
# and how long a stream waits for one when all are taken.
STREAM_POOL_SPARE = 16
STREAM_POOL_WAIT_SECONDS = 30


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A pool as large as the request threads that use it at once: a smaller one would
        # open and close a connection (a Postgres backend) for every request above its size.
        engine = make_engine(settings.database_url, pool_size=settings.api_db_pool_size,
                             max_overflow=settings.api_db_pool_size)
        try:
            # DatabaseNotMigratedError / DatabaseUnavailableError: the message says what to do.
            revision = await run_in_threadpool(check_migrations_current, engine)
            registry = await run_in_threadpool(ModelRegistry.load, settings)
            await run_in_threadpool(check_files_url, settings)   # an unusable S3 bucket: refuse to start
        except BaseException:
            engine.dispose()
            raise
        state = app.state
        state.settings = settings
        state.sessions = sessionmaker(engine, expire_on_commit=False)
        state.registry = registry
        # Adapters registered at run time are read from Postgres (rein.jobs.adapters).
        registry.adapters.sessions = state.sessions  # type: ignore[union-attr]  # load() gives a catalog
        state.redis = redis_client(settings.redis_url)
        # Event followers block in XREAD for BLOCK_MS (the socket timeout outlasts it), each on a
        # connection of its own: a pool as large as the streams served, where a stream beyond it
        # waits for a connection rather than failing.
        state.async_redis = async_redis_client(
            settings.redis_url, max_connections=settings.max_event_streams + STREAM_POOL_SPARE,
            timeout=STREAM_POOL_WAIT_SECONDS, socket_timeout=STREAM_SOCKET_TIMEOUT)
        state.stream_slots = StreamSlots(settings.max_streams_per_key)
        state.download_slots = StreamSlots(settings.max_downloads_per_key)
        state.large_body_slots = StreamSlots(settings.max_large_bodies_per_key)
        state.celery = make_celery(settings)
        state.key_cache = KeyCache(settings.auth_cache_seconds)
        state.limiter = RateLimiter(state.redis, RedisKeys.from_settings(settings), settings)
        # Commits concurrent requests' jobs together (rein.api.intake).
        state.filestore = filestore_for(settings)
        state.intake = JobIntake(settings, state.sessions, state.celery, state.limiter,
                                 registry, state.filestore).start()
        # Validates, feeds, expires and finalizes batches (all state in Postgres, see its docstring).
        state.batch_manager = BatchManager(settings, state.sessions, state.redis, state.celery, registry,
                                           state.filestore).start()
        # Takes back expired leases and sends lost messages again (rein.jobs.reaper); the
        # workers run one too, and one pass at a time runs in the deployment.
        state.reaper = Reaper(settings, state.sessions, state.redis, state.celery, name="rein-api-reaper").start()
        # Deletes results, output files and usage past their retention (rein.jobs.retention).
        state.retention = RetentionLoop(settings, state.sessions, state.filestore).start()
        # Delivers the batch events of the webhooks' outbox (rein.batches.webhooks.delivery).
        state.webhooks = WebhookDeliverer(settings, state.sessions,
                                         on_outcome=app.state.metrics.count_webhook).start()
        state.started_at = int(time.time())
        log.info("rein api ready: database at revision %s, models %s", revision,
                 ", ".join(e.name for e in registry) or "none")
        try:
            yield
        finally:
            await run_in_threadpool(state.webhooks.stop)
            await run_in_threadpool(state.reaper.stop)
            await run_in_threadpool(state.retention.stop)
            await run_in_threadpool(state.batch_manager.stop)
            await run_in_threadpool(state.intake.stop)
            await state.async_redis.aclose()
            state.redis.close()
            state.celery.close()
            engine.dispose()

    app = FastAPI(
        title="rein",
        version="0.1.0",
        summary="Message-queue-driven batch inference for LLMs: OpenAI-compatible and async jobs.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    for module in (openai, embeddings, tokenize, jobs, files, batches, usage, lora, webhooks, health):
        app.include_router(module.router)
    # Prometheus: every response counted and timed by route template; GET /metrics.
    app.state.metrics = APIMetrics(settings)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    # A body's size and a key's presence are checked before anything reads the body.
    app.add_middleware(RequestLimits, max_bytes=settings.max_request_bytes)
    # x-request-id, x-should-retry and the rate-limit headers, on every response (413s too).
    app.add_middleware(HTTPConventions)
    if settings.allowed_origins:
        # Outermost: a browser's preflight is answered before any check, and every answer,
        # errors included, carries the CORS headers. Off by default (rein.api.conventions).
        app.add_middleware(CORSMiddleware, **cors_options(settings.allowed_origins))
    app.include_router(metrics_router)
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, corrected: validation errors are 400 in OpenAI's shape, not 422."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                responses = operation.get("responses", {})
                if responses.pop("422", None) is not None:
                    responses.setdefault("400", {"description": "Bad Request",
                                                 "content": {"application/json": {"schema": error_ref}}})
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema
