"""REIN_DATABASE_URL with several hosts (rein.store.db.database_url), on the real Postgres with a
dead first host: libpq's form (`@h1:p1,h2:p2/db`) and SQLAlchemy's (`?host=h1:p1&host=h2:p2`)
both work for `rein migrate` (which creates the database), `rein keys` and the engine the API
and the worker use; a URL whose hosts are all dead names them all in its error.
tests/e2e/test_failover.py runs the whole service on such a URL."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from rein.cli.main import main
from rein.store.db import (
    check_migrations_current,
    database_url,
    make_engine,
    psycopg_conninfo,
    server_location,
)
from rein.store.migrate import head_revision

DEAD = "127.0.0.1:1"     # nothing listens there: a connection is refused at once


def libpq_form(url: str) -> str:
    """`url` with the dead host first, in libpq's multi-host form."""
    parsed = make_url(url)
    userinfo = parsed.username + (f":{parsed.password}" if parsed.password else "") + "@"
    return (f"postgresql+psycopg://{userinfo}{DEAD},{parsed.host}:{parsed.port or 5432}/{parsed.database}"
            f"?target_session_attrs=read-write")


def test_the_libpq_form_becomes_sqlalchemys() -> None:
    url = database_url("postgresql+psycopg://u:pw@h1:5433,h2/rein?target_session_attrs=read-write")
    assert url.query["host"] == ("h1:5433", "h2:5432") and url.database == "rein" and url.password == "pw"
    assert server_location(url) == "h1:5433,h2:5432"
    assert psycopg_conninfo(url) == {"dbname": "rein", "user": "u", "password": "pw", "host": "h1,h2",
                                          "port": "5433,5432", "target_session_attrs": "read-write"}
    assert database_url("postgresql+psycopg://u@h1:5432/rein") == make_url("postgresql+psycopg://u@h1:5432/rein")


@pytest.mark.parametrize("form", ["libpq", "sqlalchemy"])
def test_migrate_keys_and_the_engine_skip_a_dead_first_host(make_database, capsys, form: str) -> None:
    url = libpq_form(make_database(create=False))
    if form == "sqlalchemy":
        url = database_url(url).render_as_string(hide_password=False)
    name = database_url(url).database
    assert main(["migrate", "--database-url", url]) == 0
    assert f"database {name}: created" in capsys.readouterr().out
    assert main(["migrate", "--database-url", url, "--check"]) == 0
    assert main(["keys", "--database-url", url, "create", "--name", "multi", "--scopes", "inference"]) == 0
    capsys.readouterr()
    engine = make_engine(url, poolclass=NullPool)
    try:
        assert check_migrations_current(engine) == head_revision()
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM api_keys WHERE name = 'multi'")).scalar() == 1
    finally:
        engine.dispose()


def test_every_host_dead_names_them_all(capsys) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:1,127.0.0.1:2/rein"
    assert main(["migrate", "--database-url", url]) == 2
    assert "cannot connect to Postgres at 127.0.0.1:1,127.0.0.1:2" in capsys.readouterr().err
