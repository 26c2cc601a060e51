"""Redis clients and the Celery broker from REIN_REDIS_URL: the one place that reads that URL.

Every Redis connection rein makes (the API's and the worker's clients, the token streams, the
rate limiter, `rein top`, `rein keys`, the Celery broker) comes from here, so one URL form means
the same server, credentials and TLS rule everywhere. Two forms:

* redis-py's own URLs: `redis://[[user]:password@]host:port/db`, `rediss://...` (TLS, the server's
  certificate verified unless `ssl_cert_reqs=none`), `unix:///path?db=N`.
* Redis Sentinel: `redis+sentinel://[[user]:password@]host1:26379,host2:26379/master_name[/db]`
  (`rediss+sentinel://` for TLS to the sentinels and to the master). The user and password are
  the master's; `sentinel_username` / `sentinel_password` query parameters authenticate to the
  sentinels when they need it; the `ssl_*` query parameters are those of `rediss://`. A port left
  out is 26379. redis-py clients ask the sentinels for the master on every new connection (and
  after a connection error), so after a failover they reach the promoted replica; the broker is
  kombu's `sentinel://` transport with `master_name` in its transport options.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}   # scheme -> TLS
SENTINEL_PORT = 26379
SSL_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname")
CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass(frozen=True)
class SentinelUrl:
    """A `redis+sentinel://` URL, parsed."""

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    ssl_options: dict[str, Any] = field(default_factory=dict)   # redis-py keywords, CERT_* values

    def ssl_kwargs(self) -> dict[str, Any]:
        """redis-py's TLS keywords (none without TLS); the certificate required unless told."""
        if not self.tls:
            return {}
        return {"ssl": True, "ssl_cert_reqs": ssl.CERT_REQUIRED} | self.ssl_options

    def master_kwargs(self) -> dict[str, Any]:
        credentials = {"username": self.username, "password": self.password}
        return {"db": self.db} | {k: v for k, v in credentials.items() if v is not None} | self.ssl_kwargs()

    def sentinel_kwargs(self, client_kwargs: dict[str, Any]) -> dict[str, Any]:
        """The sentinels' connection keywords: the client's socket_* options (as redis-py does),
        the sentinel credentials and TLS."""
        credentials = {"username": self.sentinel_username, "password": self.sentinel_password}
        return ({k: v for k, v in client_kwargs.items() if k.startswith("socket_")}
                | {k: v for k, v in credentials.items() if v is not None} | self.ssl_kwargs())


def parse_sentinel_url(url: str) -> SentinelUrl | None:
    """The Sentinel URL's parts; None for any other URL (redis-py's own forms)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SENTINEL_SCHEMES:
        return None
    parts = urlsplit(f"redis://{rest}")
    where = f"REIN_REDIS_URL ({scheme}://...)"
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = tuple(_host_port(host, where) for host in hosts.split(",") if host)
    path = [p for p in parts.path.split("/") if p]
    if not sentinels or not path or len(path) > 2:
        raise ValueError(f"{where}: expected {scheme}://[[user]:password@]host:26379[,host2:26379...]"
                         f"/master_name[/db]")
    try:
        db = int(path[1]) if len(path) == 2 else 0
    except ValueError:
        raise ValueError(f"{where}: the database {path[1]!r} is not a number") from None
    query = dict(parse_qsl(parts.query))
    unknown = set(query) - {"sentinel_username", "sentinel_password", *SSL_OPTIONS}
    if unknown:
        raise ValueError(f"{where}: unknown query parameter(s) {', '.join(sorted(unknown))}; known: "
                         f"sentinel_username, sentinel_password, {', '.join(SSL_OPTIONS)}")
    options: dict[str, Any] = {k: v for k, v in query.items() if k in SSL_OPTIONS}
    if "ssl_cert_reqs" in options:
        try:
            options["ssl_cert_reqs"] = CERT_REQS[options["ssl_cert_reqs"].lower()]
        except KeyError:
            raise ValueError(f"REIN_REDIS_URL: ssl_cert_reqs {options['ssl_cert_reqs']!r} is not one of "
                             f"none, optional, required") from None
    if "ssl_check_hostname" in options:
        options["ssl_check_hostname"] = options["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return SentinelUrl(sentinels, unquote(path[0]), db, unquote(username) or None,
                       unquote(password) if userinfo and ":" in userinfo else None,
                       query.get("sentinel_username"), query.get("sentinel_password"),
                       SENTINEL_SCHEMES[scheme.lower()], options)


def _host_port(text: str, where: str) -> tuple[str, int]:
    if text.startswith("["):                     # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    try:
        return host, int(port) if port else SENTINEL_PORT
    except ValueError:
        raise ValueError(f"{where}: the sentinel port in {text!r} is not a number") from None


def redis_client(url: str, **kwargs: Any):
    """A redis-py client for REIN_REDIS_URL; `kwargs` are the connection options (timeouts)."""
    from redis import Redis

    target = parse_sentinel_url(url)
    if target is None:
        return Redis.from_url(url, **kwargs)
    from redis.sentinel import Sentinel

    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_kwargs(kwargs))
    return sentinel.master_for(target.master_name, **(target.master_kwargs() | kwargs))


def async_redis_client(url: str, *, max_connections: int, timeout: float, **kwargs: Any):
    """A redis.asyncio client on a blocking pool of `max_connections` (a caller beyond it waits up
    to `timeout` seconds for a connection rather than failing)."""
    from redis.asyncio import BlockingConnectionPool
    from redis.asyncio import Redis as AsyncRedis

    target = parse_sentinel_url(url)
    if target is None:
        return AsyncRedis(connection_pool=BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout, **kwargs))
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

    class BlockingSentinelConnectionPool(SentinelConnectionPool, BlockingConnectionPool):
        """The master's connections, found through the sentinels, in a blocking pool."""

    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=target.sentinel_kwargs(kwargs))
    return sentinel.master_for(target.master_name, connection_pool_class=BlockingSentinelConnectionPool,
                               max_connections=max_connections, timeout=timeout,
                               **(target.master_kwargs() | kwargs))


@dataclass(frozen=True)
class BrokerConnection:
    """What Celery needs to reach the broker: its URL, extra transport options, broker_use_ssl."""

    url: str
    transport_options: dict[str, Any]
    use_ssl: dict[str, Any] | None


def broker_connection(url: str) -> BrokerConnection:
    """The Celery broker for REIN_REDIS_URL (kombu's `sentinel://` transport for a Sentinel URL)."""
    target = parse_sentinel_url(url)
    if target is None:
        return BrokerConnection(url, {}, broker_ssl(url))
    userinfo = ""
    if target.username is not None or target.password is not None:
        userinfo = f"{quote(target.username or '', safe='')}:{quote(target.password or '', safe='')}@"
    broker = ";".join(f"sentinel://{userinfo}{_netloc(host, port)}/{target.db}" for host, port in target.sentinels)
    options: dict[str, Any] = {"master_name": target.master_name}
    sentinel_kwargs = target.sentinel_kwargs({})
    if sentinel_kwargs:
        options["sentinel_kwargs"] = sentinel_kwargs
    use_ssl = {k: v for k, v in target.ssl_kwargs().items() if k != "ssl"} if target.tls else None
    return BrokerConnection(broker, options, use_ssl)


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def broker_ssl(redis_url: str) -> dict[str, Any] | None:
    """Celery's `broker_use_ssl` for a redis-py URL: None unless it is `rediss://`.

    The URL's own `ssl_*` query parameters (ssl_cert_reqs, ssl_ca_certs, ssl_certfile,
    ssl_keyfile, ssl_check_hostname), read as kombu reads them, with the server's certificate
    required unless the URL says `ssl_cert_reqs=none`. Left alone, kombu connects to a
    `rediss://` URL that names no ssl_* parameter with CERT_NONE (a warning, no verification),
    while redis-py, whose clients the API and the worker run beside the broker, verifies by
    default: one URL, one rule for every connection.
    """
    from kombu.utils.url import parse_url

    try:
        parts = parse_url(redis_url)
    except KeyError as exc:   # kombu's parse_ssl_cert_reqs knows none, optional, required
        raise ValueError(f"REIN_REDIS_URL: ssl_cert_reqs {exc} is not one of none, optional, required") from None
    if parts["transport"] != "rediss":
        return None
    options = dict(parts.get("ssl") or {})
    options.setdefault("ssl_cert_reqs", ssl.CERT_REQUIRED)
    return options


def redis_location(url: str) -> str:
    """Where a Redis URL points, without its credentials: host:port/db, the socket path, or the
    sentinels and the master's name."""
    target = parse_sentinel_url(url)
    if target is not None:
        sentinels = ",".join(_netloc(host, port) for host, port in target.sentinels)
        return f"sentinel {sentinels} master {target.master_name}/{target.db}"
    from redis.connection import parse_url

    try:
        options = parse_url(url)
    except ValueError:
        return "(unparsable REIN_REDIS_URL)"
    host = options.get("path") or f"{options.get('host', '127.0.0.1')}:{options.get('port', 6379)}"
    return f"{host}/{options.get('db', 0)}"
