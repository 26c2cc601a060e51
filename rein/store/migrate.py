"""Alembic, configured in code: upgrade the database, read its revision and the head.

The Alembic environment lives in `migrations/` at the repository root, beside the `rein`
package; rein runs from a checkout (`pip install -e .`) or from the Docker image, which
copies the repository, so the directory is found from this file's location (or, failing
that, in the working directory). No alembic.ini is needed.

A new revision (after changing rein/store/tables.py):

    .venv/bin/python -c "from alembic import command; from rein.store.migrate import alembic_config; \
        command.revision(alembic_config(), message='add files', autogenerate=True, rev_id='0002')"

then review the generated file: autogenerate is a draft, the test in
tests/integration/test_store.py checks that models and migrations agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Connection, Engine, inspect, text

from rein.core.settings import Settings, get_settings

# Alembic announces each of its plugins at INFO on every run; that is noise in rein's logs.
logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

# Serializes concurrent `rein migrate` runs (compose's migrate service and `rein up`, say).
_LOCK_ID = 0x7265696E  # "rein"


def migrations_dir() -> Path:
    candidates = [Path(__file__).resolve().parents[2] / "migrations", Path.cwd() / "migrations"]
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    raise FileNotFoundError(
        "rein's migrations/ directory was not found (looked in "
        + ", ".join(str(p) for p in candidates)
        + "): run rein from a checkout of the repository or from its Docker image")


def alembic_config(database_url: str | None = None):
    """An Alembic Config for migrations/, on database_url (default: the settings')."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    from rein.store.db import database_url as parse_database_url

    # Several hosts in libpq's form: SQLAlchemy's own form, which migrations/env.py can open.
    url = parse_database_url(database_url or get_settings().database_url).render_as_string(hide_password=False)
    # ConfigParser treats '%' as interpolation; URL-encoded passwords contain it.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


@lru_cache(maxsize=1)
def _script():
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(migrations_dir()))


def head_revision() -> str:
    head = _script().get_current_head()
    if head is None:
        raise FileNotFoundError(f"no migration found in {migrations_dir() / 'versions'}")
    return head


def known_revisions() -> set[str]:
    return {script.revision for script in _script().walk_revisions()}


def current_revision(engine: Engine | Connection) -> str | None:
    """The database's Alembic revision; None for a database never migrated."""
    if isinstance(engine, Engine):
        with engine.connect() as conn:
            return current_revision(conn)
    # Read directly: Alembic's MigrationContext logs two INFO lines per look.
    if not inspect(engine).has_table("alembic_version"):
        return None
    versions = engine.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return ",".join(sorted(versions)) or None


@dataclass(frozen=True)
class UpgradeReport:
    database: str
    created_database: bool
    before: str | None
    after: str


def upgrade(settings: Settings | None = None, revision: str = "head") -> UpgradeReport:
    """Create the database if it is missing and upgrade it to `revision` (default: the latest)."""
    from alembic import command
    from sqlalchemy.pool import NullPool

    from rein.store.db import database_name, ensure_database_exists, make_engine

    settings = settings or get_settings()
    created = ensure_database_exists(settings.database_url)
    engine = make_engine(settings.database_url, poolclass=NullPool)
    try:
        config = alembic_config(settings.database_url)
        with engine.begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _LOCK_ID})
            before = current_revision(conn)
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
            after = current_revision(conn)
    finally:
        engine.dispose()
    return UpgradeReport(database_name(settings.database_url), created, before, after or "")
