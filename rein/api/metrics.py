"""The API's Prometheus metrics and its `GET /metrics` route.

* `rein:api_requests_total{route,method,status}` and
  `rein:api_request_duration_seconds{route}` (intake latency: until the response headers
  are sent, so a token stream counts its start, not its length) come from
  `MetricsMiddleware`, a pure ASGI middleware around the whole app. `route` is the route
  template (`/v1/jobs/{job_id}`), never the raw path, so ids do not become labels; a path
  no route matches is `unmatched`.
* `rein:api_rate_limited_total{key_id,kind}`: the middleware also counts 429 responses
  whose error code is `rate_limit_exceeded`, by the caller's key id (read from the
  Authorization header, whose secret part is never kept) and the limit hit (`requests` or
  `tokens`, the error's `type`). Only refused keys get a label, and a key must have
  authenticated to be refused, so a flood of made-up keys cannot multiply the series.
* `rein:queue_depth{model_name,priority}`: jobs waiting in each served model's queue,
  read from Redis (LLEN of the broker's priority lists) when Prometheus scrapes.
* `rein:webhook_deliveries_total{result}` and `rein:webhook_events_failed_total`: the webhooks'
  deliverer's tries and the events it gave up on (rein.batches.webhooks.delivery).

Every metric lives in the app's own `CollectorRegistry` (`app.state.metrics.registry`),
so tests can build several apps in one process. With several API processes
(REIN_API_WORKERS > 1) `rein api` gives them a shared PROMETHEUS_MULTIPROC_DIR:
prometheus_client then keeps each process's values in files there, and a scrape of any
process reports the sum over all of them (queue depth: the latest reading).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from redis.exceptions import RedisError

from rein.api.deps import BearerDep, require_scope
from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.core.settings import Settings
from rein.jobs.queues import PRIORITY_STEPS, priority_lists
from rein.store.keys import parse_key

log = logging.getLogger(__name__)

INTAKE_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                          10.0, 30.0, 60.0, 120.0, 300.0)
UNMATCHED_ROUTE = "unmatched"
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
PRIORITY_NAMES = {PRIORITY_INTERACTIVE: "interactive", PRIORITY_BATCH: "batch"}

router = APIRouter()


class APIMetrics:
    """The API process's metrics, in their own registry."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # prometheus_client appends `_total` to counter names itself.
        self.requests = Counter(
            "rein:api_requests",
            "HTTP requests answered, by route template, method and status code.",
            ("route", "method", "status"),
            registry=r,
        )
        self.request_duration = Histogram(
            "rein:api_request_duration_seconds",
            "Time from a request's arrival to its response headers (intake latency), "
            "by route template.",
            ("route",),
            buckets=INTAKE_LATENCY_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter(
            "rein:api_rate_limited",
            "Requests refused with 429 by a key's rate limit, by key id and "
            "limit (requests: RPM, tokens: TPM).",
            ("key_id", "kind"),
            registry=r,
        )
        self.queue_depth = Gauge(
            "rein:queue_depth",
            "Jobs waiting in a served model's queue, by priority (read at scrape time).",
            ("model_name", "priority"),
            registry=r,
            multiprocess_mode="mostrecent",   # read by whichever process is scraped
        )
        self._depth_labels: set[tuple[str, str]] = set()
        # The webhooks' deliverer (rein.batches.webhooks.delivery) runs in the API process.
        self.webhook_deliveries = Counter(
            "rein:webhook_deliveries",
            "Webhook delivery tries, by result (success: a 2xx answer; failure: anything else).",
            ("result",),
            registry=r,
        )
        self.webhook_events_failed = Counter(
            "rein:webhook_events_failed",
            "Webhook events given up on (retried for REIN_WEBHOOK_RETRY_SECONDS, or their endpoint removed).",
            registry=r,
        )

    def observe_response(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.request_duration.labels(route).observe(seconds)

    def count_webhook(self, delivered: bool | None, gave_up: bool) -> None:
        """One outcome of the webhooks' deliverer: a try (delivered or not; None: nothing sent), and
        whether its event was given up on."""
        if delivered is not None:
            self.webhook_deliveries.labels("success" if delivered else "failure").inc()
        if gave_up:
            self.webhook_events_failed.inc()

    async def refresh_queue_depth(self, redis: Any) -> None:
        """LLEN of every served model's priority lists, in one round trip (asyncio Redis)."""
        models = [m.name for m in self.settings.models]
        # (model, step, how many lists it has: a batch step has one per shard, rein.jobs.affinity).
        counts: list[tuple[str, int, int]] = []
        pipe = redis.pipeline(transaction=False)
        for model in models:
            for step in PRIORITY_STEPS:
                lists = priority_lists(self.settings, model, step)
                counts.append((model, step, len(lists)))
                for key in lists:
                    pipe.llen(key)
        try:
            lengths = await pipe.execute()
        except (RedisError, OSError) as exc:
            # No figure rather than a stale one: the series vanish until Redis answers again.
            log.warning("queue depth not read for /metrics: %s", exc)
            self.queue_depth.clear()
            self._depth_labels.clear()
            return
        start = 0
        for model, step, count in counts:
            depth, start = sum(lengths[start:start + count]), start + count
            labels = (model, PRIORITY_NAMES.get(step, str(step)))
            # The API's two priorities always; another step once it has held a job.
            if depth or step in PRIORITY_NAMES or labels in self._depth_labels:
                self._depth_labels.add(labels)
                self.queue_depth.labels(*labels).set(depth)

    def exposition(self) -> bytes:
        if self.settings.prometheus_multiproc_dir:
            # Every API process's values, from the files they all write.
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=self.settings.prometheus_multiproc_dir)
            return generate_latest(registry)
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request, credentials: BearerDep) -> Response:
    """Prometheus text exposition of the API's metrics: for a key with the `admin` scope
    (key ids and queue depths are not for every tenant to see), or anyone with
    REIN_METRICS_PUBLIC."""
    if not request.app.state.settings.metrics_public:
        await require_scope("admin")(request, credentials)
    api_metrics: APIMetrics = request.app.state.metrics
    redis = getattr(request.app.state, "async_redis", None)
    if redis is not None:
        await api_metrics.refresh_queue_depth(redis)
    return Response(api_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def route_template(scope: dict[str, Any]) -> str:
    """The matched route's path template, or `unmatched`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED_ROUTE


def key_id_of(scope: dict[str, Any]) -> str:
    """The key id of the request's `Authorization: Bearer rein_<id>_<secret>`; else `unknown`."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            parsed = parse_key(token) if scheme.lower() == "bearer" else None
            return parsed[0] if parsed else "unknown"
    return "unknown"


def rate_limit_kind(body: bytes) -> str | None:
    """`requests` or `tokens` for a rate-limit error body; None for any other 429."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(error, dict) or error.get("code") != "rate_limit_exceeded":
        return None
    kind = error.get("type")
    return kind if kind in ("requests", "tokens") else "unknown"


class MetricsMiddleware:
    """Pure ASGI middleware: counts and times every HTTP response, and rate-limit refusals."""

    def __init__(self, app: Any, metrics: APIMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        response: dict[str, Any] = {"status": None, "body": b""}

        async def send_and_watch(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                response["status"] = message["status"]
                self._observe(scope, message["status"], started)
            elif message["type"] == "http.response.body" and response["status"] == 429:
                response["body"] += message.get("body", b"")
                if not message.get("more_body", False):
                    self._count_rate_limited(scope, response["body"])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except Exception:
            if response["status"] is None:   # Starlette's outer error middleware answers 500
                self._observe(scope, 500, started)
            raise

    def _observe(self, scope: dict[str, Any], status: int, started: float) -> None:
        method = scope.get("method", "")
        self.metrics.observe_response(route_template(scope), method if method in METHODS else "other",
                                      status, time.perf_counter() - started)

    def _count_rate_limited(self, scope: dict[str, Any], body: bytes) -> None:
        kind = rate_limit_kind(body)
        if kind is not None:
            self.metrics.rate_limited.labels(key_id_of(scope), kind).inc()
