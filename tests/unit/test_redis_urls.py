"""REIN_REDIS_URL's forms (rein.store.redis_client): redis-py's own URLs pass through, and the
`redis+sentinel://` form becomes a Sentinel-managed redis-py client and kombu's `sentinel://`
broker with `master_name`. No server: what the clients would connect with is inspected.
tests/e2e/test_failover.py runs the service on real sentinels through a failover."""

from __future__ import annotations

import ssl

import pytest
from redis.sentinel import SentinelConnectionPool

from rein.core.settings import Settings
from rein.jobs.queues import make_celery
from rein.store.redis_client import (
    async_redis_client,
    broker_connection,
    parse_sentinel_url,
    redis_client,
    redis_location,
)

URL = "redis+sentinel://:s%40cret@s1:26380,s2,[::1]:26381/mymaster/2"


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    target = parse_sentinel_url(URL)
    assert target is not None
    assert target.sentinels == (("s1", 26380), ("s2", 26379), ("::1", 26381))
    assert (target.master_name, target.db, target.password, target.tls) == ("mymaster", 2, "s@cret", False)
    assert parse_sentinel_url("redis+sentinel://s1/m").db == 0
    assert parse_sentinel_url("redis://h:6379/0") is None


@pytest.mark.parametrize("url", ["redis+sentinel://s1:26379", "redis+sentinel://s1/m/x",
                                 "redis+sentinel://s1:port/m", "redis+sentinel://s1/m/0?ssl=yes",
                                 "rediss+sentinel://s1/m/0?ssl_cert_reqs=sometimes"])
def test_a_bad_sentinel_url_says_what_is_wrong(url: str) -> None:
    with pytest.raises(ValueError, match="REIN_REDIS_URL"):
        parse_sentinel_url(url)


def test_the_broker_is_kombus_sentinel_transport_with_the_master_name() -> None:
    broker = broker_connection(URL)
    assert broker.url == ("sentinel://:s%40cret@s1:26380/2;sentinel://:s%40cret@s2:26379/2;"
                          "sentinel://:s%40cret@[::1]:26381/2")
    assert broker.transport_options == {"master_name": "mymaster"} and broker.use_ssl is None
    app = make_celery(Settings(redis_url=URL))
    options = app.conf.broker_transport_options
    assert options["master_name"] == "mymaster" and options["visibility_timeout"] > 0
    with app.connection_for_write() as connection:
        assert connection.transport_cls == "sentinel"
        assert connection.password == "s@cret"
        assert len(connection.alt) == 3


def test_tls_and_sentinel_credentials_reach_the_broker_and_the_sentinels() -> None:
    url = "rediss+sentinel://u:pw@s1/m/0?sentinel_password=sp&ssl_ca_certs=/ca.pem"
    broker = broker_connection(url)
    assert broker.use_ssl == {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.pem"}
    assert broker.transport_options["sentinel_kwargs"] == {
        "password": "sp", "ssl": True, "ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": "/ca.pem"}
    client = redis_client(url, socket_timeout=3)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "m"
    assert pool.connection_class.__name__ == "SentinelManagedSSLConnection"
    assert {k: pool.connection_kwargs[k] for k in ("username", "password", "db", "socket_timeout")} == {
        "username": "u", "password": "pw", "db": 0, "socket_timeout": 3}
    assert pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] == "sp"


def test_a_plain_url_is_redis_pys_own() -> None:
    assert broker_connection("redis://h:6379/1").url == "redis://h:6379/1"
    client = redis_client("redis://h:6379/1", socket_timeout=3)
    assert client.connection_pool.connection_kwargs["host"] == "h"


def test_the_async_client_waits_for_a_connection_of_the_masters_pool() -> None:
    from redis.asyncio import BlockingConnectionPool

    client = async_redis_client(URL, max_connections=7, timeout=2.5, socket_timeout=9)
    pool = client.connection_pool
    assert isinstance(pool, BlockingConnectionPool) and pool.service_name == "mymaster"
    assert (pool.max_connections, pool.timeout, pool.connection_kwargs["socket_timeout"]) == (7, 2.5, 9)


def test_the_location_hides_credentials() -> None:
    assert redis_location(URL) == "sentinel s1:26380,s2:26379,[::1]:26381 master mymaster/2"
