"""Bearer-key authentication for the API, with a short per-process cache.

Every request needs its key checked, and reading the key row from Postgres is a round trip
and a pool checkout on the hottest path there is. So an API process remembers a key it
has checked for `Settings.auth_cache_seconds` (default 1 s): within that time a revoked key
may still be accepted by a process that checked it just before, never longer. Refusals are
remembered for the same time, in a bounded table of their own, so one bad key sent in a
loop costs one Postgres read a second, and keys sent once each can only clear that table,
not the table of good keys. Entries are keyed by a SHA-256 of the whole bearer key, so the
cache holds no secret and a lookup compares digests, not secrets.

The API checks the key before it reads a byte of the body (rein.api.checked_route).
"""

from __future__ import annotations

import hashlib
import threading
import time

from sqlalchemy.orm import Session, sessionmaker

from rein.store.keys import InvalidKeyError, KeyInfo, authenticate

MAX_ENTRIES = 10_000


class KeyCache:
    """Recently verified keys: digest of the bearer key → (KeyInfo, expiry on the monotonic clock)."""

    def __init__(self, ttl_seconds: float, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[KeyInfo, float]] = {}
        self._refusals: dict[bytes, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> KeyInfo | None:
        return self._lookup(self._entries, digest)

    def put(self, digest: bytes, info: KeyInfo) -> None:
        self._store(self._entries, digest, info)

    def refusal(self, digest: bytes) -> str | None:
        """Why this key was refused within the last ttl seconds, or None."""
        return self._lookup(self._refusals, digest)

    def put_refusal(self, digest: bytes, reason: str) -> None:
        self._store(self._refusals, digest, reason)

    def _lookup(self, table: dict, digest: bytes):
        entry = table.get(digest)
        if entry is None:
            return None
        value, expires = entry
        if time.monotonic() >= expires:
            with self._lock:
                table.pop(digest, None)
            return None
        return value

    def _store(self, table: dict, digest: bytes, value: object) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(table) >= self.max_entries:
                table.clear()   # rare: a simple bound beats an LRU on this path
            table[digest] = (value, time.monotonic() + self.ttl)


def key_digest(bearer: str) -> bytes:
    """What the cache is keyed by: a SHA-256 of the whole bearer key."""
    return hashlib.sha256(bearer.encode()).digest()


def authenticate_and_remember(sessions: sessionmaker[Session], cache: KeyCache, digest: bytes,
                              bearer: str) -> KeyInfo:
    """Check the key against Postgres (blocking) and remember the answer. InvalidKeyError when
    it is not valid."""
    with sessions() as session:
        try:
            info = authenticate(session, bearer)
        except InvalidKeyError as exc:
            cache.put_refusal(digest, str(exc))
            raise
    cache.put(digest, info)
    return info
