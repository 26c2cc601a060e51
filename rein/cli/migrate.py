"""`rein migrate`: create the database if it is missing and upgrade it to the latest schema.

`--check` changes nothing: it says whether the database is current and exits 1 if not
(for scripts and health checks). SQLAlchemy and Alembic are imported only when it runs.
A database or Redis URL whose password is a placeholder (CHANGE-ME) is refused before
anything connects (rein.core.settings.refuse_placeholder_secrets).
"""

from __future__ import annotations

import argparse
import sys

from rein.core.settings import SettingsError, load_settings, refuse_placeholder_secrets

# SQLAlchemy and Alembic (rein.store.db, rein.store.migrate) are imported inside the commands:
# every `rein` command loads this module (rein.cli.main), and only these need them.


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "migrate", help="create/upgrade the Postgres database to the latest schema",
        description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", metavar="URL", default=None,
                        help="Postgres URL (default: REIN_DATABASE_URL)")
    parser.add_argument("--check", action="store_true",
                        help="only report whether the database is current (exit 1 if not)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from rein.store.db import StoreError

    try:
        return _check(args) if args.check else _upgrade(args)
    except (SettingsError, StoreError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SQLAlchemyError as exc:
        print(f"error: migration failed: {exc}", file=sys.stderr)
        return 2


def _settings(args: argparse.Namespace):
    overrides = {"database_url": args.database_url} if args.database_url else {}
    settings = load_settings(**overrides)
    refuse_placeholder_secrets(settings)
    return settings


def _upgrade(args: argparse.Namespace) -> int:
    from rein.store.migrate import upgrade

    report = upgrade(_settings(args))
    if report.created_database:
        print(f"database {report.database}: created")
    if report.before == report.after:
        print(f"database {report.database}: already at revision {report.after} (latest)")
    else:
        print(f"database {report.database}: upgraded from revision {report.before or '(none)'} "
              f"to {report.after} (latest)")
    return 0


def _check(args: argparse.Namespace) -> int:
    from sqlalchemy.pool import NullPool

    from rein.store.db import DatabaseNotMigratedError, database_name, make_engine
    from rein.store.db import check_migrations_current as check

    settings = _settings(args)
    engine = make_engine(settings.database_url, poolclass=NullPool)
    try:
        revision = check(engine)
    except DatabaseNotMigratedError as exc:
        print(str(exc))
        return 1
    finally:
        engine.dispose()
    print(f"database {database_name(settings.database_url)}: at revision {revision} (latest)")
    return 0
