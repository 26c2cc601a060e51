"""The webhooks' deliverer (rein.batches.webhooks.delivery) on a real Postgres outbox and real HTTP:
several deliverers share the outbox without sending an event twice (FOR UPDATE SKIP LOCKED),
an event past REIN_WEBHOOK_RETRY_SECONDS is marked failed, an event whose endpoint was removed
fails unsent, and the destination is checked again at delivery (a name that now resolves to a
private address is refused, and recorded as a failed attempt)."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from webhook_receiver import Receiver

from rein.batches.webhooks.delivery import WebhookDeliverer, prune_events
from rein.batches.webhooks.endpoints import delete_endpoint, set_endpoint
from rein.batches.webhooks.events import new_event_id
from rein.store.keys import create_key
from rein.store.tables import WebhookAttempt, WebhookEvent

LOCAL = {"webhook_allow_private": True, "webhook_allow_http": True}


@pytest.fixture
def receiver():
    started = Receiver()
    yield started
    started.close()


def add_endpoint(sessions, tenant: str, url: str) -> str:
    with sessions.begin() as session:
        key = create_key(session, name="admin", tenant=tenant, scopes="admin")
        return set_endpoint(session, tenant, url, ["batch.completed"], key.info.key_id).secret


def add_events(sessions, tenant: str, count: int) -> list[str]:
    ids = [new_event_id() for _ in range(count)]
    with sessions.begin() as session:
        session.add_all(WebhookEvent(id=event_id, tenant=tenant, type="batch.completed", batch_id=f"batch_{n}")
                        for n, event_id in enumerate(ids))
    return ids


def events(sessions, ids: list[str]) -> dict[str, WebhookEvent]:
    with sessions() as session:
        return {e.id: e for e in session.scalars(select(WebhookEvent).where(WebhookEvent.id.in_(ids)))}


def attempts(sessions, ids: list[str]) -> list[WebhookAttempt]:
    with sessions() as session:
        return list(session.scalars(select(WebhookAttempt).where(WebhookAttempt.event_id.in_(ids))))


def drain(deliverer: WebhookDeliverer) -> None:
    while deliverer.deliver_due():
        pass


def test_several_deliverers_send_each_event_once(make_settings, db_sessionmaker, tenant, receiver):
    add_endpoint(db_sessionmaker, tenant, receiver.url)
    ids = add_events(db_sessionmaker, tenant, 24)
    deliverers = [WebhookDeliverer(make_settings(**LOCAL), db_sessionmaker) for _ in range(3)]
    try:
        threads = [threading.Thread(target=drain, args=(d,)) for d in deliverers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        for deliverer in deliverers:
            deliverer.stop()
    sent = sorted(headers["webhook-id"] for headers, _ in receiver.requests)
    assert sent == sorted(ids)                                    # every event, none twice
    assert {e.status for e in events(db_sessionmaker, ids).values()} == {"delivered"}
    assert sorted(a.event_id for a in attempts(db_sessionmaker, ids)) == sorted(ids)


def test_an_event_past_its_retry_window_fails(make_settings, db_sessionmaker, tenant):
    receiver = Receiver(statuses=[503] * 5)
    try:
        add_endpoint(db_sessionmaker, tenant, receiver.url)
        [event_id] = add_events(db_sessionmaker, tenant, 1)
        deliverer = WebhookDeliverer(make_settings(webhook_retry_seconds=0.5, webhook_backoff_seconds=0.2, **LOCAL),
                                     db_sessionmaker)
        try:
            deadline = datetime.now(UTC).timestamp() + 10
            while events(db_sessionmaker, [event_id])[event_id].status == "pending":
                assert datetime.now(UTC).timestamp() < deadline, "the event never gave up"
                deliverer.deliver_due()
        finally:
            deliverer.stop()
    finally:
        receiver.close()
    event = events(db_sessionmaker, [event_id])[event_id]
    assert event.status == "failed" and event.failed_at is not None
    assert event.last_error == "the receiver answered 503"
    tried = attempts(db_sessionmaker, [event_id])
    assert len(tried) == event.attempts >= 2 and {a.status_code for a in tried} == {503}


def test_an_event_whose_endpoint_was_removed_fails_unsent(make_settings, db_sessionmaker, tenant, receiver):
    add_endpoint(db_sessionmaker, tenant, receiver.url)
    [event_id] = add_events(db_sessionmaker, tenant, 1)
    with db_sessionmaker.begin() as session:
        delete_endpoint(session, tenant)
    deliverer = WebhookDeliverer(make_settings(**LOCAL), db_sessionmaker)
    try:
        drain(deliverer)
    finally:
        deliverer.stop()
    event = events(db_sessionmaker, [event_id])[event_id]
    assert (event.status, event.attempts) == ("failed", 0) and "no webhook endpoint" in event.last_error
    assert receiver.requests == [] and attempts(db_sessionmaker, [event_id]) == []


def test_the_destination_is_checked_again_at_delivery(make_settings, db_sessionmaker, tenant, receiver):
    # Set when the name resolved to a public address; by delivery it resolves to the metadata service.
    add_endpoint(db_sessionmaker, tenant, "https://hooks.example.com/rein")
    [event_id] = add_events(db_sessionmaker, tenant, 1)
    deliverer = WebhookDeliverer(make_settings(), db_sessionmaker, resolver=lambda host, port: ["169.254.169.254"])
    try:
        assert deliverer.deliver_due() == 1
    finally:
        deliverer.stop()
    [attempt] = attempts(db_sessionmaker, [event_id])
    assert attempt.status_code is None and attempt.error.startswith("destination refused:")
    assert "169.254.169.254 (link-local)" in attempt.error
    event = events(db_sessionmaker, [event_id])[event_id]
    assert event.status == "pending" and event.next_attempt_at > event.created_at   # retried later


def test_old_finished_events_are_pruned_with_their_attempts(make_settings, db_sessionmaker, tenant):
    long_ago = datetime.now(UTC) - timedelta(days=40)
    ids = {name: new_event_id() for name in ("old_delivered", "old_failed", "old_pending", "new_delivered")}
    with db_sessionmaker.begin() as session:
        for name, event_id in ids.items():
            session.add(WebhookEvent(id=event_id, tenant=tenant, type="batch.completed", batch_id="batch_x",
                                     status=name.split("_")[1], created_at=long_ago if name.startswith("old")
                                     else datetime.now(UTC)))
        session.flush()
        session.add(WebhookAttempt(event_id=ids["old_delivered"], attempt=1, url="https://x", started_at=long_ago,
                                   duration_ms=5, status_code=200))
    settings = make_settings(webhook_event_retention_days=30, retention_batch=1)
    assert prune_events(settings, db_sessionmaker) >= 2
    left = events(db_sessionmaker, list(ids.values()))
    assert sorted(left) == sorted([ids["old_pending"], ids["new_delivered"]])   # pending ones are never pruned
    assert attempts(db_sessionmaker, [ids["old_delivered"]]) == []
    assert prune_events(make_settings(webhook_event_retention_days=0), db_sessionmaker) == 0


def test_https_goes_to_the_checked_address_and_verifies_the_urls_name(tmp_path):
    """post_pinned connects to the address the check resolved, yet sends the URL's Host and TLS
    name, and the certificate is verified against that name (not the address)."""
    import ssl
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import httpx

    from rein.batches.webhooks.delivery import post_pinned
    from rein.batches.webhooks.destinations import Destination

    ca_pem, cert_pem, key_pem = _certificates("hooks.test")
    (tmp_path / "cert.pem").write_bytes(cert_pem)
    (tmp_path / "key.pem").write_bytes(key_pem)
    hosts: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:   # noqa: N802
            self.rfile.read(int(self.headers["content-length"]))
            hosts.append(self.headers["host"])
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    trust = ssl.create_default_context(cadata=ca_pem.decode())
    try:
        with httpx.Client(verify=trust, timeout=10) as client:
            url = f"https://hooks.test:{port}/rein"
            response = post_pinned(client, Destination(url, "https", "hooks.test", port, ("127.0.0.1",)), b"{}",
                                   {"content-type": "application/json"})
            assert response.status_code == 204 and hosts == [f"hooks.test:{port}"]
            # The same server under another name: its certificate does not match, so no delivery.
            other = f"https://other.test:{port}/rein"
            with pytest.raises(httpx.ConnectError, match="certificate|hostname"):
                post_pinned(client, Destination(other, "https", "other.test", port, ("127.0.0.1",)), b"{}", {})
    finally:
        server.shutdown()
        server.server_close()


def _certificates(name: str) -> tuple[bytes, bytes, bytes]:
    """A CA and a certificate for `name` it signed: (CA cert, cert, key), PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.now(UTC)

    def build(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - timedelta(hours=1)).not_valid_after(now + timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                decipher_only=False), critical=True)
            builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                            critical=False)
        else:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
            builder = builder.add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build("rein test CA", ca_key, "rein test CA", ca_key, True)
    cert = build(name, key, "rein test CA", ca_key, False)
    pem = serialization.Encoding.PEM
    return (ca.public_bytes(pem), cert.public_bytes(pem),
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
