"""Integration fixtures: a fresh Postgres database and a Redis key namespace per test run.

Each run works in its own database `rein_test_<run id>_<n>`, dropped at the end of the run
(pass or fail), and in its own Redis key prefix `rein_test_<run id>:`, so parallel runs never
collide. The servers come from the environment (tests, unlike rein, may read it):

- REIN_TEST_POSTGRES_URL: a server URL with a maintenance database, default
  postgresql+psycopg://postgres@127.0.0.1:5432/postgres
- REIN_TEST_REDIS_URL: default redis://127.0.0.1:6379/15

A server that cannot be reached skips the tests that need it, with the reason; under CI
(CI=true) it fails them instead, since CI starts both (.ci/run).
"""

from __future__ import annotations

import itertools
import os
import secrets
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest
from sqlalchemy import Engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker
from support import connect_postgres, delete_prefixed, unreachable

from rein.core.settings import Settings, get_settings

if TYPE_CHECKING:
    import redis

    from rein.store.messages import JobMessage

RUN_ID = secrets.token_hex(4)
POSTGRES_URL = os.environ.get("REIN_TEST_POSTGRES_URL",
                              "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("REIN_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
REDIS_PREFIX = f"rein_test_{RUN_ID}:"


@pytest.fixture(scope="session")
def postgres_url() -> URL:
    """The Postgres server's maintenance URL (skips or fails when it cannot be reached)."""
    import psycopg

    url = make_url(POSTGRES_URL)
    try:
        connect_postgres(url).close()
    except psycopg.OperationalError as exc:
        unreachable(f"PostgreSQL at {url.host}:{url.port or 5432}", exc)
    return url


@pytest.fixture(scope="session")
def make_database(postgres_url: URL) -> Iterator[Callable[..., str]]:
    """`make_database(create=True) -> url`: a new empty database, dropped when the run ends.

    With create=False the URL names a database that does not exist yet (it is still dropped
    at the end, if something created it).
    """
    from psycopg import sql

    counter = itertools.count()
    names: list[str] = []

    def make(create: bool = True) -> str:
        name = f"rein_test_{RUN_ID}_{next(counter)}"
        names.append(name)
        if create:
            with connect_postgres(postgres_url) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return postgres_url.set(database=name).render_as_string(hide_password=False)

    yield make

    def drop(name: str) -> None:
        with connect_postgres(postgres_url) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    # Each DROP waits for a checkpoint (about a second); dropped together, they share one.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(drop, names))


@pytest.fixture(scope="session")
def database_url(make_database: Callable[..., str]) -> str:
    """URL of this run's database, migrated to the latest revision."""
    from rein.store.migrate import upgrade

    url = make_database()
    upgrade(Settings(database_url=url))
    return url


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The test Redis URL (skips or fails when Redis cannot be reached)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        unreachable(f"Redis at {REDIS_URL}", exc)
    finally:
        client.close()
    return REDIS_URL


def _delete_prefixed(url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        delete_prefixed(client, prefix)
    finally:
        client.close()


@pytest.fixture(scope="session")
def make_settings(database_url: str, redis_url: str) -> Iterator[Callable[..., Settings]]:
    """`make_settings(**overrides) -> Settings` on this run's database and Redis prefix.

    Overrides are validated like the environment (models="tiny=/path@512" parses).
    """
    def make(**overrides: object) -> Settings:
        # No background reaper pass (rein.jobs.reaper) unless a test asks for one: the tests
        # share one database, and a pass would send other tests' queued jobs again.
        values: dict[str, object] = {"database_url": database_url, "redis_url": redis_url,
                                     "redis_key_prefix": REDIS_PREFIX, "models": (),
                                     "reaper_interval_seconds": 3600}
        return Settings(**(values | overrides))

    yield make
    _delete_prefixed(redis_url, REDIS_PREFIX)


@pytest.fixture(scope="session")
def settings(make_settings: Callable[..., Settings]) -> Settings:
    """Settings on this run's migrated database and Redis key prefix, no models served."""
    return make_settings()


@pytest.fixture
def settings_env(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """`settings`, also put in the environment (REIN_*) so get_settings() and subprocesses see it."""
    monkeypatch.setenv("REIN_DATABASE_URL", settings.database_url)
    monkeypatch.setenv("REIN_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("REIN_REDIS_KEY_PREFIX", settings.redis_key_prefix)
    monkeypatch.delenv("REIN_MODELS", raising=False)
    get_settings.cache_clear()
    yield settings
    get_settings.cache_clear()


@pytest.fixture(scope="session")
def db_engine(settings: Settings) -> Iterator[Engine]:
    """An engine on this run's migrated database."""
    from rein.store.db import make_engine

    engine = make_engine(settings.database_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def db_sessionmaker(db_engine: Engine) -> sessionmaker[Session]:
    """Sessions on this run's database; commits are real (use unique tenants and names)."""
    return sessionmaker(db_engine, expire_on_commit=False)


@pytest.fixture
def db_session(db_sessionmaker: sessionmaker[Session]) -> Iterator[Session]:
    """A session closed after the test; what it did not commit is rolled back."""
    with db_sessionmaker() as session:
        yield session


@pytest.fixture(scope="session")
def redis_prefix() -> str:
    """This run's Redis key prefix, `rein_test_<run id>:` (also settings.redis_key_prefix)."""
    return REDIS_PREFIX


@pytest.fixture
def redis_client(redis_url: str, redis_prefix: str) -> Iterator[redis.Redis]:
    """A redis.Redis on the test Redis (no Postgres needed); keys under redis_prefix are deleted after."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()
    _delete_prefixed(redis_url, redis_prefix)


@pytest.fixture
def tenant() -> str:
    """A tenant name no other test uses."""
    return f"t-{secrets.token_hex(4)}"


@pytest.fixture
def make_job(db_sessionmaker, tenant) -> Callable[..., JobMessage]:
    """Insert a queued job (and its tenant's key) and return its queue message."""
    from rein.core.priorities import PRIORITY_INTERACTIVE
    from rein.store.messages import JobMessage
    from rein.store.tables import ApiKey, Job

    key_id = f"k{secrets.token_hex(6)}"
    with db_sessionmaker.begin() as session:
        session.add(ApiKey(key_id=key_id, name="test", tenant=tenant, secret_hash=b"x" * 32,
                           scopes=["inference"]))

    def make(prompt: list[int] | None = None, max_tokens: int = 6, endpoint: str = "/v1/completions",
             priority: int = PRIORITY_INTERACTIVE, model: str = "tiny", **sampling: object) -> JobMessage:
        prompt = prompt or [5, 6, 7, 8]
        sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
        job = Job(tenant=tenant, key_id=key_id, model=model, endpoint=endpoint,
                  params={"body": {}, "sampling": sampling}, prompt_token_ids=prompt, prompt_tokens=len(prompt),
                  priority=priority)
        with db_sessionmaker.begin() as session:
            session.add(job)
        return JobMessage(job_id=job.id, model=model, endpoint=endpoint, prompt_token_ids=prompt,
                          sampling=sampling, priority=priority, tenant=tenant, key_id=key_id)

    return make
