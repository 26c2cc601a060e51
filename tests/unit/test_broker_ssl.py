"""make_celery on a `rediss://` URL: the broker connection uses TLS and verifies the server's
certificate unless the URL says otherwise (kombu alone would connect with CERT_NONE), and a
`redis://` URL stays plain. No server: what the Celery app would connect with is inspected.
tests/integration/test_redis_tls.py connects to a TLS redis-server for real."""

from __future__ import annotations

import ssl

import pytest
from redis.connection import SSLConnection

from rein.core.settings import Settings
from rein.jobs.queues import broker_ssl, make_celery


def connection_ssl(url: str) -> object:
    app = make_celery(Settings(redis_url=url))
    with app.connection_for_write() as connection:
        return connection.ssl


def test_a_rediss_url_without_parameters_verifies_the_server() -> None:
    url = "rediss://:secret@redis.example:6380/0"
    app = make_celery(Settings(redis_url=url))
    assert app.conf.broker_use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    assert connection_ssl(url) == {"ssl_cert_reqs": ssl.CERT_REQUIRED}


def test_the_urls_ssl_parameters_are_kept() -> None:
    url = ("rediss://:secret@redis.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/rein/ca.pem"
           "&ssl_certfile=/etc/rein/client.pem&ssl_keyfile=/etc/rein/client.key")
    expected = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/etc/rein/ca.pem",
                "ssl_certfile": "/etc/rein/client.pem", "ssl_keyfile": "/etc/rein/client.key"}
    assert make_celery(Settings(redis_url=url)).conf.broker_use_ssl == expected
    assert connection_ssl(url) == expected


def test_a_ca_alone_still_requires_a_valid_certificate() -> None:
    assert broker_ssl("rediss://redis.example/0?ssl_ca_certs=/ca.pem") == \
        {"ssl_ca_certs": "/ca.pem", "ssl_cert_reqs": ssl.CERT_REQUIRED}


def test_verification_is_off_only_when_the_url_says_so() -> None:
    assert broker_ssl("rediss://redis.example/0?ssl_cert_reqs=none") == {"ssl_cert_reqs": ssl.CERT_NONE}


def test_a_plain_url_uses_no_tls() -> None:
    app = make_celery(Settings(redis_url="redis://127.0.0.1:6379/0"))
    assert not app.conf.broker_use_ssl
    assert not connection_ssl("redis://127.0.0.1:6379/0")


def test_an_unknown_cert_reqs_value_is_an_error() -> None:
    with pytest.raises(ValueError, match="ssl_cert_reqs 'sometimes' is not one of none, optional, required"):
        broker_ssl("rediss://redis.example/0?ssl_cert_reqs=sometimes")


def test_the_broker_channel_opens_ssl_connections() -> None:
    """The parameters reach kombu's Redis channel: its connection class is redis-py's TLS one."""
    app = make_celery(Settings(redis_url="rediss://:secret@redis.example:6380/0"))
    with app.connection_for_write() as connection:
        channel = connection.transport.Channel.__new__(connection.transport.Channel)
        channel.connection = connection.transport
        params = channel._connparams()
    assert params["connection_class"] is SSLConnection or issubclass(params["connection_class"], SSLConnection)
    assert params["ssl_cert_reqs"] == ssl.CERT_REQUIRED and params["password"] == "secret"
