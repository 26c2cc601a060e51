"""Fixtures for the API tests: the app on this run's Postgres and Redis, keys, a fake worker.

`make_client(**settings overrides)` gives a FastAPI TestClient (lifespan run) serving the
tiny llama model as `tiny` with a 512-token context. `make_key(tenant, scopes, ...)` creates
a real API key and returns its secret. `fake_worker` does what a worker would, by hand:
XADD TokenEvents with ids `<seq>-0` and record the result, usage and status in Postgres.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from api_support import FakeWorker
from fastapi.testclient import TestClient

from rein.store.keys import create_key, revoke_key
from rein.store.redis_keys import RedisKeys


@pytest.fixture(scope="session")
def model_dir(tiny_models) -> str:
    return str(tiny_models("llama"))


@pytest.fixture
def make_client(make_settings, model_dir, redis_client) -> Iterator[Callable[..., TestClient]]:
    """`make_client(**overrides) -> TestClient`; the Redis keys of the run are cleared after the test."""
    clients: list[TestClient] = []

    def make(**overrides: Any) -> TestClient:
        from rein.api.app import create_app

        overrides.setdefault("models", f"tiny={model_dir}@512")
        client = TestClient(create_app(make_settings(**overrides)))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()


@pytest.fixture
def make_key(db_sessionmaker) -> Callable[..., str]:
    def make(tenant: str, scopes: str = "inference,usage", *, rpm: int | None = None,
             tpm: int | None = None, revoked: bool = False) -> str:
        with db_sessionmaker.begin() as session:
            created = create_key(session, name=f"key-{secrets.token_hex(3)}", tenant=tenant, scopes=scopes,
                                 rpm=rpm, tpm=tpm)
            if revoked:
                revoke_key(session, created.info.key_id)
        return created.key

    return make


@pytest.fixture
def fake_worker(redis_client, settings, db_sessionmaker) -> FakeWorker:
    return FakeWorker(redis_client, RedisKeys.from_settings(settings), db_sessionmaker)


@pytest.fixture
def end_leftover_batches(db_sessionmaker) -> Iterator[None]:
    """Every app's batch manager works on every unfinished batch in the run's database: end
    this test's leftovers so that they do not feed the queues of the next test (the batch
    modules use it for every test)."""
    yield
    from sqlalchemy import update

    from rein.batches.manager import ACTIVE_STATUSES
    from rein.store.tables import Batch

    with db_sessionmaker.begin() as session:
        session.execute(update(Batch).where(Batch.status.in_(ACTIVE_STATUSES)).values(status="cancelled"))
