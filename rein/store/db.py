"""Connections to Postgres: the engine and sessions, creating the database, the migration check.

The API and the worker call `check_migrations_current(engine)` at start and refuse to run
when it raises: a schema they do not expect would fail later, request by request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote

from sqlalchemy import Connection, Engine, Row, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from rein.core.settings import Settings, get_settings

log = logging.getLogger(__name__)


class StoreError(RuntimeError):
    """Postgres cannot be used as it is; the message says what to do."""


class DatabaseNotMigratedError(StoreError):
    """The database is missing or its schema is not the revision this code expects."""


class DatabaseUnavailableError(StoreError):
    """The Postgres server cannot be reached."""


def engine_of(sessions: sessionmaker[Session]) -> Engine:
    """The engine a sessionmaker binds its sessions to."""
    return sessions.kw["bind"]


def execute_all(engine: Engine, sql: str, params: tuple[Any, ...]) -> list[Row[Any]]:
    """Run one SQL statement as its own transaction (autocommit: one round trip); its rows.

    For the hottest single-statement writes (the API's job INSERT, a worker's claim and its
    record): there, building and compiling SQLAlchemy statements per call cost more CPU than
    everything else the write does. `sql` uses the driver's `%s` placeholders; errors still
    come out as SQLAlchemy's, and a broken connection is still dropped from the pool.
    """
    with engine.connect() as conn:
        return conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(sql, params).all()


def execute_one(engine: Engine, sql: str, params: tuple[Any, ...]) -> Row[Any] | None:
    """`execute_all`'s first row, for a statement that returns at most one."""
    rows = execute_all(engine, sql, params)
    return rows[0] if rows else None


class HeldConnections:
    """`execute_all` for a thread that runs statement after statement (the API's committer):
    each thread keeps its autocommitted connection between statements instead of checking
    one out of the pool for each.

    A checkout is not free: the pool's pre-ping is a round trip, and taking the connection
    out and putting it back (switching it to autocommit and back) cost about as much CPU as
    the statement itself. A connection idle for `idle_seconds` goes back to the pool before
    the next statement, so after a quiet spell, when Postgres may have restarted, the pool
    checks the connection first as it always does; one that broke (invalidated) is replaced.
    """

    def __init__(self, engine: Engine, idle_seconds: float = 1.0, *, shared: bool = False) -> None:
        """`shared`: one connection for every thread, used by one statement at a time (for
        writers that take turns anyway, as a group commit's: rein.jobs.group_commit)."""
        self.engine = engine
        self.idle_seconds = idle_seconds
        self._local: Any = SimpleNamespace() if shared else threading.local()
        self._turn = threading.Lock() if shared else None
        self._held: set[Connection] = set()
        self._lock = threading.Lock()

    def execute_all(self, sql: str, params: tuple[Any, ...]) -> list[Row[Any]]:
        if self._turn is None:
            return self._connection().exec_driver_sql(sql, params).all()
        with self._turn:
            return self._connection().exec_driver_sql(sql, params).all()

    def execute_one(self, sql: str, params: tuple[Any, ...]) -> Row[Any] | None:
        rows = self.execute_all(sql, params)
        return rows[0] if rows else None

    def _connection(self) -> Connection:
        local = self._local
        conn: Connection | None = getattr(local, "conn", None)
        now = time.monotonic()
        if conn is not None and (conn.invalidated or conn.closed or now - local.used > self.idle_seconds):
            self._release(conn)
            conn = None
        if conn is None:
            conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            with self._lock:
                self._held.add(conn)
        local.conn, local.used = conn, now
        return conn

    def _release(self, conn: Connection) -> None:
        with self._lock:
            self._held.discard(conn)
        conn.close()

    def close(self) -> None:
        """Return every thread's connection to the pool (when those threads are done)."""
        with self._lock:
            held, self._held = list(self._held), set()
        for conn in held:
            conn.close()


def database_url(url: str | URL) -> URL:
    """REIN_DATABASE_URL as a SQLAlchemy URL, where libpq's multi-host form is allowed too.

    `postgresql+psycopg://user@h1:5432,h2:5432/rein?target_session_attrs=read-write` (which
    SQLAlchemy cannot parse: the port would be "5432,h2:5432") becomes SQLAlchemy's own
    multi-host form, `...@/rein?host=h1:5432&host=h2:5432&target_session_attrs=read-write`, which
    its psycopg dialect hands to libpq as `host=h1,h2 port=5432,5432`: libpq tries the hosts in
    order, and `target_session_attrs=read-write` skips a standby, so after a failover the pool's
    next connection reaches the new primary. A host without a port gets 5432 (SQLAlchemy wants
    all ports or none).
    """
    if isinstance(url, URL):
        return url
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if not sep or "," not in hosts:
        return make_url(url)
    path, _, query = tail.partition("?")
    named = [host if host.rpartition(":")[2].isdigit() and not host.endswith("]") else f"{host}:5432"
             for host in hosts.split(",") if host]
    params = "&".join([*(f"host={quote(host, safe=':[]')}" for host in named), *([query] if query else [])])
    return make_url(f"{scheme}://{userinfo}{at}/{path}?{params}")


def server_location(url: str | URL) -> str:
    """host:port of the URL's server, or each of its hosts (comma-separated), for messages."""
    url = database_url(url)
    hosts = url.query.get("host")
    if hosts:
        return ",".join((hosts,) if isinstance(hosts, str) else hosts)
    return f"{url.host or 'localhost'}:{url.port or 5432}"


def make_engine(url: str | URL, **kwargs: object) -> Engine:
    """A SQLAlchemy engine (on `database_url(url)`: several hosts allowed); pre-ping so a
    restarted Postgres costs one retry, not an error.

    `hide_parameters`: a failed statement's error (and so any log line quoting it) names the
    statement but not its bound values, which hold prompts and other tenants' data.
    """
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("hide_parameters", True)
    return create_engine(database_url(url), **kwargs)


@lru_cache(maxsize=8)
def _engine_for(url: str) -> Engine:
    return make_engine(url)


def get_engine(settings: Settings | None = None) -> Engine:
    """The process-wide engine for settings.database_url (one pool per URL)."""
    return _engine_for((settings or get_settings()).database_url)


def get_sessionmaker(settings: Settings | None = None) -> sessionmaker[Session]:
    """Sessions on get_engine(settings); objects stay readable after commit."""
    return sessionmaker(get_engine(settings), expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session] | None = None) -> Iterator[Session]:
    """A session that commits when the block ends and rolls back if it raises."""
    session = (factory or get_sessionmaker())()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def database_name(url: str | URL) -> str:
    return database_url(url).database or ""


def psycopg_conninfo(url: str | URL) -> dict[str, object]:
    """Connection keywords for psycopg from a SQLAlchemy URL (query options and several hosts
    included): the ones SQLAlchemy's psycopg dialect connects with."""
    url = database_url(url)
    _, info = url.get_dialect()().create_connect_args(url)
    info.pop("context", None)     # the dialect's type adapters, of no use to a plain connection
    return info


def ensure_database_exists(url: str | URL, maintenance_db: str = "postgres") -> bool:
    """CREATE DATABASE for url's database if it does not exist; True when it was created.

    Connects to `maintenance_db` on the same server (CREATE DATABASE cannot run inside
    the target itself, nor inside a transaction).
    """
    import psycopg
    from psycopg import errors, sql

    url = database_url(url)
    name = url.database
    if not name:
        raise StoreError(f"the database URL {url.render_as_string(hide_password=True)} names no database")
    info = psycopg_conninfo(url) | {"dbname": maintenance_db}
    try:
        conn = psycopg.connect(autocommit=True, connect_timeout=10, **info)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailableError(
            f"cannot connect to Postgres at {server_location(url)} "
            f"(database {maintenance_db}): {str(exc).strip()}") from exc
    with conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists:
            return False
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except errors.DuplicateDatabase:   # another `rein migrate` won the race
            return False
    log.info("created database %s", name)
    return True


def check_migrations_current(engine: Engine) -> str:
    """The database's revision when it is the latest; DatabaseNotMigratedError otherwise.

    Also DatabaseNotMigratedError when the database does not exist, and
    DatabaseUnavailableError when the server cannot be reached.
    """
    from rein.store.migrate import current_revision, head_revision

    name = database_name(engine.url)
    head = head_revision()
    try:
        current = current_revision(engine)
    except OperationalError as exc:
        if f'database "{name}" does not exist' in str(exc.orig):
            raise DatabaseNotMigratedError(
                f"database {name} does not exist (need revision {head}): run `rein migrate`") from exc
        raise DatabaseUnavailableError(
            f"cannot connect to Postgres at {server_location(engine.url)}: "
            f"{str(exc.orig).strip()}") from exc
    if current == head:
        return current
    from rein.store.migrate import known_revisions

    if current is not None and current not in known_revisions():
        raise DatabaseNotMigratedError(
            f"database {name} is at revision {current}, which this version of rein does not know "
            f"(need {head}): it was migrated by a newer rein; run that version")
    raise DatabaseNotMigratedError(
        f"database {name} is not migrated (at revision {current}, need {head}): run `rein migrate`")
