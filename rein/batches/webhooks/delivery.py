"""Delivering webhook events from the outbox: claim what is due, sign, POST, record, retry.

Each API process runs a `WebhookDeliverer` thread. A pass claims up to DELIVERY_THREADS due
events in one short transaction (`FOR UPDATE SKIP LOCKED`, so any number of processes share
the outbox and none waits on another), moving each one's `next_attempt_at` a lease ahead and
counting the attempt; the POSTs then run with no transaction open, on a small thread pool, and
each outcome is written with its attempt row (url, start, duration, status code or error). A
process that dies mid-delivery leaves the lease to run out, and the event is tried again by
whoever comes next: delivery is at least once, as Standard Webhooks specifies, and every try
carries the event's id as `webhook-id`, so a receiver drops the repeats.

Each try is signed afresh (the `standardwebhooks` package: `webhook-id`, `webhook-timestamp`,
`webhook-signature`), so its timestamp is within the receivers' five-minute tolerance, with the
tenant's current secret. The destination is checked again before every try (rein.batches.
webhooks.destinations) and the POST goes to the very addresses the check resolved; redirects
are not followed. A 2xx answer delivers the event; anything else (another status, a refused
connection, a timeout, a destination refused) is retried after REIN_WEBHOOK_BACKOFF_SECONDS,
doubling each time up to REIN_WEBHOOK_BACKOFF_MAX_SECONDS, with jitter, until the event is
REIN_WEBHOOK_RETRY_SECONDS old; then it is marked failed. An event whose tenant removed its
endpoint (or unsubscribed from its type) fails at once, unsent.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
from sqlalchemy import case, delete, func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from standardwebhooks.webhooks import Webhook

from rein.batches.webhooks.destinations import (
    Destination,
    DestinationRefused,
    Resolver,
    check_destination,
    resolve,
)
from rein.batches.webhooks.events import event_payload
from rein.core.settings import Settings
from rein.store.tables import WebhookAttempt, WebhookEndpoint, WebhookEvent

log = logging.getLogger(__name__)

DELIVERY_THREADS = 4
LEASE_MARGIN_SECONDS = 30      # beyond the timeout: how long a claimed event stays another process's
MAX_ERROR_CHARS = 500
USER_AGENT = "rein-webhooks/1"

# Told of each outcome, for metrics: (delivered: True/False, None when nothing was sent; the
# event given up on).
OutcomeCounter = Callable[[bool | None, bool], None]


@dataclass(frozen=True)
class Claimed:
    id: str
    tenant: str
    type: str
    batch_id: str
    created_at: datetime
    attempt: int


@dataclass(frozen=True)
class Outcome:
    url: str
    started_at: datetime
    duration_ms: int
    status_code: int | None = None
    error: str | None = None

    @property
    def delivered(self) -> bool:
        return self.error is None


def backoff_seconds(attempt: int, settings: Settings, rng: random.Random | None = None) -> float:
    """The wait after the `attempt`-th failed try: base x 2^(attempt-1), capped, +-25% jitter."""
    base = min(settings.webhook_backoff_max_seconds, settings.webhook_backoff_seconds * 2 ** min(attempt - 1, 40))
    return base * (rng or random).uniform(0.75, 1.25)


def signed_headers(secret: str, event_id: str, payload: bytes, now: datetime | None = None) -> dict[str, str]:
    """The Standard Webhooks headers for one try (signed with the `standardwebhooks` package)."""
    now = now or datetime.now(UTC)
    return {"webhook-id": event_id, "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(event_id, now, payload),
            "content-type": "application/json", "user-agent": USER_AGENT}


def post_pinned(client: httpx.Client, destination: Destination, payload: bytes, headers: dict[str, str]
                ) -> httpx.Response:
    """POST to the addresses the destination check resolved, in turn until one connects, with the
    URL's own Host header (and TLS name, for https, which the certificate is verified against), so a
    second DNS answer is never used. The answer's body is not read: only its status counts, and a
    receiver cannot make rein hold a large or endless body."""
    url = httpx.URL(destination.url)
    last: httpx.TransportError | None = None
    for address in destination.addresses:
        request = client.build_request(
            "POST", url.copy_with(host=address), content=payload,
            headers=headers | {"host": url.netloc.decode("ascii")},
            extensions={"sni_hostname": destination.host} if destination.scheme == "https" else {})
        try:
            response = client.send(request, follow_redirects=False, stream=True)
        except httpx.ConnectError as exc:
            last = exc
            continue
        response.close()
        return response
    assert last is not None
    raise last


class WebhookDeliverer:
    """The delivery loop of one process: `start()`, `stop()`, or `deliver_due()` for one pass."""

    def __init__(self, settings: Settings, sessions: sessionmaker[Session], *,
                 on_outcome: OutcomeCounter | None = None, resolver: Resolver = resolve,
                 name: str = "rein-webhooks") -> None:
        self.settings = settings
        self.on_outcome = on_outcome
        self.sessions = sessions
        self.resolver = resolver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._pool = ThreadPoolExecutor(max_workers=DELIVERY_THREADS, thread_name_prefix=f"{name}-post")
        self._client = httpx.Client(timeout=settings.webhook_timeout_seconds, follow_redirects=False,
                                    trust_env=False)   # no proxy from the environment: the check is ours
        # httpx's timeout bounds each phase (connect, write, read), not the whole try: a lease of
        # four of them and a margin outlasts any try, so no second process sends while one is.
        self.lease = timedelta(seconds=settings.webhook_timeout_seconds * 4 + LEASE_MARGIN_SECONDS)

    # -- the loop ---------------------------------------------------------------------------

    def start(self) -> WebhookDeliverer:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the tries under way (each ends within REIN_WEBHOOK_TIMEOUT_SECONDS)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout if timeout is not None else self.settings.webhook_timeout_seconds + 5)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def _run(self) -> None:
        next_prune = time.monotonic()
        while not self._stop.is_set():
            if time.monotonic() >= next_prune:
                next_prune = time.monotonic() + self.settings.retention_interval_seconds
                self._prune()
            try:
                busy = self.deliver_due() == DELIVERY_THREADS
            except SQLAlchemyError as exc:    # Postgres away: try again next poll
                log.warning("webhook delivery pass failed (%s)", exc.__class__.__name__)
                busy = False
            except Exception:
                log.exception("webhook delivery pass failed")
                busy = False
            if not busy:
                self._stop.wait(self.settings.webhook_poll_seconds)

    def _prune(self) -> None:
        try:
            pruned = prune_events(self.settings, self.sessions)
        except SQLAlchemyError as exc:
            log.warning("webhook events not pruned (%s)", exc.__class__.__name__)
            return
        if pruned:
            log.info("webhook events: %d past REIN_WEBHOOK_EVENT_RETENTION_DAYS deleted", pruned)

    # -- one pass ---------------------------------------------------------------------------

    def deliver_due(self) -> int:
        """Claim the events due now (at most DELIVERY_THREADS), try each, record each; how many."""
        claimed, endpoints = self._claim(DELIVERY_THREADS)
        futures = [self._pool.submit(self._deliver_one, event, endpoints.get(event.tenant)) for event in claimed]
        for future in futures:
            future.result()
        return len(claimed)

    def _claim(self, limit: int) -> tuple[list[Claimed], dict[str, WebhookEndpoint]]:
        due = (select(WebhookEvent.id)
               .where(WebhookEvent.status == "pending", WebhookEvent.next_attempt_at <= func.now())
               .order_by(WebhookEvent.next_attempt_at).limit(limit).with_for_update(skip_locked=True))
        with self.sessions() as session, session.begin():
            rows = session.execute(
                update(WebhookEvent).where(WebhookEvent.id.in_(due.scalar_subquery()))
                .values(attempts=WebhookEvent.attempts + 1, next_attempt_at=func.now() + self.lease)
                .returning(WebhookEvent.id, WebhookEvent.tenant, WebhookEvent.type, WebhookEvent.batch_id,
                           WebhookEvent.created_at, WebhookEvent.attempts)).all()
            claimed = [Claimed(*row) for row in rows]
            tenants = {event.tenant for event in claimed}
            endpoints = {endpoint.tenant: endpoint for endpoint in session.scalars(
                select(WebhookEndpoint).where(WebhookEndpoint.tenant.in_(tenants)))} if tenants else {}
        return claimed, endpoints

    def _deliver_one(self, event: Claimed, endpoint: WebhookEndpoint | None) -> None:
        try:
            if endpoint is None or event.type not in endpoint.event_types:
                why = ("the tenant has no webhook endpoint any more" if endpoint is None
                       else f"the tenant's endpoint no longer subscribes to {event.type}")
                self._give_up(event, why)
                return
            outcome = self.attempt(event, endpoint)
            self._record(event, outcome)
        except Exception:   # (recording failed: the lease runs out and the event is tried again)
            log.exception("webhook event %s: delivery not recorded", event.id)

    def attempt(self, event: Claimed, endpoint: WebhookEndpoint) -> Outcome:
        """One try: check the destination, sign, POST; what happened (never raises for the receiver's faults)."""
        started_at = datetime.now(UTC)
        started = time.monotonic()

        def outcome(status_code: int | None = None, error: str | None = None) -> Outcome:
            return Outcome(endpoint.url, started_at, int((time.monotonic() - started) * 1000), status_code,
                           error[:MAX_ERROR_CHARS] if error else None)

        try:
            destination = check_destination(endpoint.url, self.settings, self.resolver)
        except DestinationRefused as exc:
            return outcome(error=f"destination refused: {exc}")
        payload = event_payload(event.id, event.type, event.created_at, event.batch_id)
        try:
            response = post_pinned(self._client, destination, payload,
                                   signed_headers(endpoint.secret, event.id, payload))
        except httpx.TimeoutException:
            return outcome(error=f"no answer within {self.settings.webhook_timeout_seconds:g} s")
        except httpx.HTTPError as exc:
            return outcome(error=f"{type(exc).__name__}: {exc}")
        if 200 <= response.status_code < 300:
            return outcome(response.status_code)
        return outcome(response.status_code, f"the receiver answered {response.status_code}"
                       + (" (redirects are not followed)" if response.is_redirect else ""))

    # -- records ----------------------------------------------------------------------------

    def _record(self, event: Claimed, outcome: Outcome) -> None:
        mine = (WebhookEvent.id == event.id, WebhookEvent.attempts == event.attempt,
                WebhookEvent.status == "pending")   # still ours: no later claim took it over
        with self.sessions() as session, session.begin():
            session.add(WebhookAttempt(event_id=event.id, attempt=event.attempt, url=outcome.url,
                                       started_at=outcome.started_at, duration_ms=outcome.duration_ms,
                                       status_code=outcome.status_code, error=outcome.error))
            if outcome.delivered:
                session.execute(update(WebhookEvent).where(*mine).values(
                    status="delivered", delivered_at=func.now(), last_error=None))
                gave_up = False
            else:
                next_at = func.now() + timedelta(seconds=backoff_seconds(event.attempt, self.settings))
                too_late = WebhookEvent.created_at + timedelta(seconds=self.settings.webhook_retry_seconds) < next_at
                status = session.scalar(update(WebhookEvent).where(*mine).values(
                    status=case((too_late, "failed"), else_="pending"),
                    failed_at=case((too_late, func.now()), else_=None),
                    next_attempt_at=next_at, last_error=outcome.error).returning(WebhookEvent.status))
                gave_up = status == "failed"
        self._count(outcome.delivered, gave_up)
        if outcome.delivered:
            log.info("webhook event %s (%s) delivered to %s on attempt %d", event.id, event.type, outcome.url,
                     event.attempt)
        else:
            log.warning("webhook event %s (%s) attempt %d to %s failed: %s%s", event.id, event.type, event.attempt,
                        outcome.url, outcome.error, "; giving up" if gave_up else "")

    def _give_up(self, event: Claimed, why: str) -> None:
        with self.sessions() as session, session.begin():
            session.execute(update(WebhookEvent).where(WebhookEvent.id == event.id,
                                                       WebhookEvent.attempts == event.attempt)
                            .values(status="failed", failed_at=func.now(), last_error=why,
                                    attempts=WebhookEvent.attempts - 1))   # nothing was sent
        self._count(None, True)
        log.warning("webhook event %s (%s) not delivered: %s", event.id, event.type, why)

    def _count(self, delivered: bool | None, gave_up: bool) -> None:
        if self.on_outcome is not None:
            self.on_outcome(delivered, gave_up)


def prune_events(settings: Settings, sessions: sessionmaker[Session]) -> int:
    """Delete the delivered and failed events older than REIN_WEBHOOK_EVENT_RETENTION_DAYS, with
    their attempts, REIN_RETENTION_BATCH at a time (rows another process holds are skipped: any
    number of processes may prune at once); how many."""
    days = settings.webhook_event_retention_days
    if not days:
        return 0
    deleted = 0
    while True:
        old = (select(WebhookEvent.id)
               .where(WebhookEvent.status != "pending", WebhookEvent.created_at < func.now() - timedelta(days=days))
               .limit(settings.retention_batch).with_for_update(skip_locked=True))
        with sessions() as session, session.begin():
            count = session.execute(delete(WebhookEvent).where(WebhookEvent.id.in_(old.scalar_subquery()))).rowcount
        deleted += count
        if count < settings.retention_batch:
            return deleted
