"""The per-batch Postgres advisory lock: one manager at a time steps a batch. Taken for a
transaction (`try_lock_batch`, `lock_batch_waiting`: a cancel waits for a step in progress) or
held at session level for as long as a validation takes (`hold_batch_lock`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Integer, cast, func, select, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.store.db import engine_of

# Namespace of the per-batch advisory locks ("batc"), beside rein migrate's lock.
LOCK_NAMESPACE = 0x62617463


def try_lock_batch(session: Session, batch_id: str) -> bool:
    """Take the batch's advisory lock for the session's transaction; False if someone holds it."""
    return bool(session.scalar(select(func.pg_try_advisory_xact_lock(cast(LOCK_NAMESPACE, Integer),
                                                                      func.hashtext(batch_id)))))


def lock_batch_waiting(session: Session, batch_id: str, seconds: float) -> bool:
    """Take the batch's advisory lock, waiting up to `seconds` (a manager's step on an
    in_progress batch is short; a validation may not be); False when it timed out, and then
    the session's transaction is rolled back."""
    try:
        session.execute(text(f"SET LOCAL lock_timeout = {int(seconds * 1000)}"))
        session.execute(select(func.pg_advisory_xact_lock(cast(LOCK_NAMESPACE, Integer),
                                                          func.hashtext(batch_id))))
    except OperationalError:
        session.rollback()
        return False
    return True


@contextmanager
def hold_batch_lock(sessions: sessionmaker[Session], batch_id: str) -> Iterator[Connection | None]:
    """The batch's advisory lock at session level, on a connection of its own in autocommit:
    held for as long as a validation takes without holding a transaction open. Yields that
    connection (for short reads), or None when another manager holds the lock. The same key
    as `try_lock_batch`, so the other steps skip the batch meanwhile; a process that dies
    drops its connection and with it the lock."""
    key = (cast(LOCK_NAMESPACE, Integer), func.hashtext(batch_id))
    with engine_of(sessions).connect() as connection:
        connection.execution_options(isolation_level="AUTOCOMMIT")
        if not connection.scalar(select(func.pg_try_advisory_lock(*key))):
            yield None
            return
        try:
            yield connection
        finally:
            try:
                connection.scalar(select(func.pg_advisory_unlock(*key)))
            except SQLAlchemyError:      # never hand a pooled connection back still holding it
                connection.invalidate()
