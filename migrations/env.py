"""Alembic environment for rein (configured in code by rein.store.migrate; no alembic.ini).

`rein.store.migrate.upgrade` hands in an open connection (config.attributes["connection"]),
inside a transaction that holds the migration lock. Run any other way, the URL comes from
the config's sqlalchemy.url, else from the settings (REIN_DATABASE_URL).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from rein.store.tables import Base

config = context.config
target_metadata = Base.metadata
COMPARE = {"compare_type": True, "compare_server_default": True}


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from rein.core.settings import get_settings

    return get_settings().database_url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, **COMPARE)
    with context.begin_transaction():
        context.run_migrations()


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, **COMPARE)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = create_engine(_url(), poolclass=NullPool)
    try:
        with engine.begin() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
