"""`rein keys create|list|revoke`: manage API keys in Postgres.

`create` prints the new key once, alone on its last line (`rein keys create ... | tail -n 1`
captures it); nothing else ever shows a secret. SQLAlchemy is imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys

from rein.core.settings import SettingsError, load_settings
from rein.store.redis_keys import RedisKeys

# SQLAlchemy and Redis (rein.store.db, rein.store.keys, rein.jobs.cancel) are imported inside the
# commands: every `rein` command loads this module (rein.cli.main), and only these need them.


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="create, list and revoke API keys",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", metavar="URL", default=None,
                        help="Postgres URL (default: REIN_DATABASE_URL)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    # --database-url also after the action; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--database-url", metavar="URL", default=argparse.SUPPRESS,
                        help="Postgres URL (default: REIN_DATABASE_URL)")

    create = actions.add_parser("create", parents=[common], help="create a key and print it (once)")
    create.add_argument("--name", required=True, help="a label for the key")
    create.add_argument("--scopes", required=True, metavar="LIST",
                        help="comma-separated: inference, batch, usage")
    create.add_argument("--tenant", default=None,
                        help="the tenant the key acts for; keys of one tenant share its jobs, files, batches "
                             "and usage (default: a new tenant of this key alone, printed)")
    create.add_argument("--rpm", type=_positive_int, default=None, metavar="N",
                        help="requests per minute (default: REIN_DEFAULT_RPM)")
    create.add_argument("--tpm", type=_positive_int, default=None, metavar="N",
                        help="tokens per minute, prompt + max_tokens (default: REIN_DEFAULT_TPM)")
    create.set_defaults(func=run_create)

    listing = actions.add_parser("list", parents=[common], help="list keys (never their secrets)")
    listing.add_argument("--tenant", default=None, help="only this tenant's keys")
    listing.add_argument("--active", action="store_true", help="leave out revoked keys")
    listing.set_defaults(func=run_list)

    revoke = actions.add_parser("revoke", parents=[common], help="revoke a key: it stops working at once")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key id shown by `rein keys list`")
    revoke.add_argument("--cancel-work", action="store_true",
                        help="also cancel the key's queued and running jobs and its unfinished batches "
                             "(without it, work the key already started runs to its end)")
    revoke.set_defaults(func=run_revoke)


def _session_factory(args: argparse.Namespace):
    """A sessionmaker on a migrated database (StoreError otherwise)."""
    from sqlalchemy.orm import sessionmaker
    from sqlalchemy.pool import NullPool

    from rein.store.db import check_migrations_current, make_engine

    overrides = {"database_url": args.database_url} if args.database_url else {}
    engine = make_engine(load_settings(**overrides).database_url, poolclass=NullPool)
    check_migrations_current(engine)
    return sessionmaker(engine, expire_on_commit=False)


def _guard(action):
    def run(args: argparse.Namespace) -> int:
        from rein.store.db import StoreError

        try:
            return action(args)
        except (SettingsError, StoreError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return run


def _when(value) -> str:
    from datetime import UTC

    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _limit(value: int | None) -> str:
    return "default" if value is None else str(value)


@_guard
def run_create(args: argparse.Namespace) -> int:
    from rein.store.db import session_scope
    from rein.store.keys import create_key

    with session_scope(_session_factory(args)) as session:
        created = create_key(session, name=args.name, scopes=args.scopes, tenant=args.tenant,
                             rpm=args.rpm, tpm=args.tpm)
    info = created.info
    print(f"key id:  {info.key_id}")
    print(f"name:    {info.name}")
    print(f"tenant:  {info.tenant}")
    print(f"scopes:  {', '.join(info.scopes)}")
    print(f"limits:  rpm {_limit(info.rpm_limit)}, tpm {_limit(info.tpm_limit)}")
    print("This is the only time the key is shown; store it now:")
    print(created.key)
    return 0


@_guard
def run_list(args: argparse.Namespace) -> int:
    from rein.store.db import session_scope
    from rein.store.keys import list_keys

    with session_scope(_session_factory(args)) as session:
        keys = list_keys(session, tenant=args.tenant, include_revoked=not args.active)
    rows = [("KEY ID", "NAME", "TENANT", "SCOPES", "RPM", "TPM", "CREATED (UTC)", "REVOKED (UTC)")]
    rows += [(k.key_id, k.name, k.tenant, ",".join(k.scopes), _limit(k.rpm_limit), _limit(k.tpm_limit),
              _when(k.created_at), _when(k.revoked_at)) for k in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    if not keys:
        print("(no keys)", file=sys.stderr)
    return 0


@_guard
def run_revoke(args: argparse.Namespace) -> int:
    from rein.store.db import session_scope
    from rein.store.keys import KeyNotFoundError, revoke_key

    try:
        with session_scope(_session_factory(args)) as session:
            info = revoke_key(session, args.key_id)
            cancelled = _cancel_work(session, args, info.key_id) if args.cancel_work else None
    except KeyNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"revoked key {info.key_id} ({info.name}, tenant {info.tenant}) at {_when(info.revoked_at)} UTC")
    if cancelled is not None:
        queued, running, batches = cancelled
        print(f"cancelled its work: {queued} queued jobs, {running} running jobs (stopping within a step), "
              f"{batches} batches (cancelling)")
    return 0


def _cancel_work(session, args: argparse.Namespace, key_id: str) -> tuple[int, int, int]:
    from rein.jobs.cancel import cancel_work_of_key
    from rein.store.redis_client import redis_client

    settings = load_settings(**({"database_url": args.database_url} if args.database_url else {}))
    redis = redis_client(settings.redis_url)
    try:
        return cancel_work_of_key(session, redis, RedisKeys.from_settings(settings), key_id,
                                  settings.job_timeout_seconds + settings.stream_ttl_seconds)
    finally:
        redis.close()
