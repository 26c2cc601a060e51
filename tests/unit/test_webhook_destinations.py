"""Webhook destinations (rein.batches.webhooks.destinations): https only unless allowed, and no
private, loopback, link-local, multicast, reserved or unspecified address, IPv4 or IPv6 (mapped
ones included), whether the URL names it or its host resolves to it, unless the operator allows
it; and the check runs again on every delivery, so a name that now resolves elsewhere is refused.
Also the signing (verified by the official openai client and by standardwebhooks) and the backoff."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime

import openai
import pytest
from standardwebhooks import Webhook

from rein.batches.webhooks.delivery import backoff_seconds, signed_headers
from rein.batches.webhooks.destinations import DestinationRefused, check_destination
from rein.batches.webhooks.endpoints import new_secret, secret_hint
from rein.batches.webhooks.events import event_payload
from rein.core.settings import Settings

pytestmark = pytest.mark.usefixtures("clean_rein_env")

PUBLIC = "93.184.215.14"


def fixed(*addresses: str):
    """A resolver answering `addresses` for any host."""
    return lambda host, port: list(addresses)


@pytest.mark.parametrize("url", [
    "https://169.254.169.254/latest/meta-data",    # the cloud metadata service (link-local)
    "https://10.0.0.1/", "https://172.16.5.4/", "https://192.168.1.1/",  # private
    "https://127.0.0.1:8080/", "https://[::1]/",   # loopback
    "https://0.0.0.0/", "https://[::]/",           # unspecified
    "https://224.0.0.1/", "https://[ff02::1]/",    # multicast
    "https://240.0.0.1/",                           # reserved
    "https://100.64.0.1/",                          # shared (carrier-grade NAT): not global
    "https://[fe80::1]/",                           # IPv6 link-local
    "https://[fd00::5]/",                           # IPv6 unique local
    "https://[::ffff:127.0.0.1]/", "https://[::ffff:169.254.169.254]/",  # IPv4-mapped
    "https://[2002:a00:1::]/",                      # 6to4 around 10.0.0.1
])
def test_private_addresses_are_refused(url):
    with pytest.raises(DestinationRefused, match="REIN_WEBHOOK_ALLOW_PRIVATE"):
        check_destination(url, Settings(), fixed(PUBLIC))


def test_a_public_address_passes_and_is_what_delivery_connects_to():
    destination = check_destination("https://hooks.example.com/rein?x=1", Settings(), fixed(PUBLIC, "2606:2800::1"))
    assert destination.addresses == (PUBLIC, "2606:2800::1")
    assert (destination.host, destination.port, destination.scheme) == ("hooks.example.com", 443, "https")


def test_a_name_resolving_to_a_private_address_is_refused_whichever_answer_it_is():
    with pytest.raises(DestinationRefused, match=r"hooks.example.com resolves to 10.1.2.3 \(private\)"):
        check_destination("https://hooks.example.com/", Settings(), fixed(PUBLIC, "10.1.2.3"))


def test_dns_changing_after_the_url_was_set_is_caught_at_delivery():
    answers = {"now": [PUBLIC]}
    resolver = lambda host, port: answers["now"]   # noqa: E731
    check_destination("https://rebind.example.com/", Settings(), resolver)      # when set: public
    answers["now"] = ["169.254.169.254"]                                           # the name is re-pointed
    with pytest.raises(DestinationRefused, match="169.254.169.254 .link-local."):
        check_destination("https://rebind.example.com/", Settings(), resolver)  # at delivery: refused


def test_operator_settings_open_private_networks():
    url = "https://10.20.1.5/hook"
    assert check_destination(url, Settings(webhook_allow_private=True), fixed()).addresses == ("10.20.1.5",)
    narrow = Settings(webhook_allowed_cidrs="10.20.0.0/16,fd00::/8")
    assert check_destination(url, narrow, fixed()).addresses == ("10.20.1.5",)
    assert check_destination("https://[::ffff:10.20.0.9]/", narrow, fixed())
    with pytest.raises(DestinationRefused):
        check_destination("https://10.30.0.1/", narrow, fixed())


def test_http_needs_the_operator():
    with pytest.raises(DestinationRefused, match="REIN_WEBHOOK_ALLOW_HTTP"):
        check_destination("http://hooks.example.com/", Settings(), fixed(PUBLIC))
    assert check_destination("http://hooks.example.com/", Settings(webhook_allow_http=True), fixed(PUBLIC)).port == 80


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://hooks.example.com/", "must start with https://"),
    ("hooks.example.com/path", "must start with https://"),
    ("https:///nohost", "names no host"),
    ("https://user:pw@hooks.example.com/", "user name or password"),
    ("https://hooks.example.com:99999/", "not a valid URL"),
    ("https://hooks.example.com/" + "a" * 3000, "the limit is 2048"),
    ("https://93.184.215.14/a\x00b", "control character"),
    ("https://hooks.example.com/a b", "a space"),
    ("https://hooks.example.com/#top", "fragment"),
])
def test_malformed_urls_say_what_is_wrong(url, message):
    with pytest.raises(DestinationRefused, match=message):
        check_destination(url, Settings(), fixed(PUBLIC))


def test_a_host_that_does_not_resolve():
    def fail(host, port):
        raise OSError("Name or service not known")

    with pytest.raises(DestinationRefused, match="does not resolve"):
        check_destination("https://nowhere.invalid/", Settings(), fail)


def test_signature_verified_by_the_openai_client_and_standardwebhooks():
    secret = new_secret()
    assert secret.startswith("whsec_") and secret_hint(secret) == f"whsec_…{secret[-4:]}"
    created = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
    payload = event_payload("evt_1", "batch.completed", created, "batch_1")
    headers = signed_headers(secret, "evt_1", payload)
    assert headers["webhook-id"] == "evt_1"
    event = openai.OpenAI(api_key="unused").webhooks.unwrap(payload, headers, secret=secret)
    assert (event.type, event.id, event.data.id, event.created_at, event.object) == (
        "batch.completed", "evt_1", "batch_1", int(created.timestamp()), "event")
    assert Webhook(secret).verify(payload, headers) == json.loads(payload)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        openai.OpenAI(api_key="unused").webhooks.unwrap(payload, headers, secret=new_secret())


def test_backoff_doubles_with_jitter_up_to_the_cap():
    settings = Settings(webhook_backoff_seconds=2, webhook_backoff_max_seconds=60)
    rng = random.Random(7)
    waits = [backoff_seconds(n, settings, rng) for n in range(1, 10)]
    for n, wait in enumerate(waits, start=1):
        base = min(60, 2 * 2 ** (n - 1))
        assert 0.75 * base <= wait <= 1.25 * base
    assert len({round(w, 6) for w in waits}) == len(waits)        # jittered, not a fixed schedule
