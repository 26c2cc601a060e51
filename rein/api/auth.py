"""Bearer-key authentication for the API, with a short per-process cache.

Every request needs its key checked, and reading the key row from Postgres is a round trip
and a pool checkout on the hottest path there is. So an API process remembers a key it
has checked for `Settings.auth_cache_seconds` (default 1 s): within that time a revoked key
may still be accepted by a process that checked it just before, never longer. Only
successes are remembered: a wrong, unknown or revoked key is checked against Postgres every
time, so nothing an attacker sends fills the cache. Entries are keyed by a SHA-256 of the
whole bearer key, so the cache holds no secret and a lookup compares digests, not secrets.
"""

from __future__ import annotations

import hashlib
import threading
import time

from sqlalchemy.orm import Session, sessionmaker

from rein.core.keys import KeyInfo, authenticate

MAX_ENTRIES = 10_000


class KeyCache:
    """Recently verified keys: digest of the bearer key → (KeyInfo, expiry on the monotonic clock)."""

    def __init__(self, ttl_seconds: float, max_entries: int = MAX_ENTRIES) -> None:
        self.ttl = ttl_seconds
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[KeyInfo, float]] = {}
        self._lock = threading.Lock()

    def get(self, digest: bytes) -> KeyInfo | None:
        entry = self._entries.get(digest)
        if entry is None:
            return None
        info, expires = entry
        if time.monotonic() >= expires:
            with self._lock:
                self._entries.pop(digest, None)
            return None
        return info

    def put(self, digest: bytes, info: KeyInfo) -> None:
        if self.ttl <= 0:
            return
        with self._lock:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()   # rare: a simple bound beats an LRU on this path
            self._entries[digest] = (info, time.monotonic() + self.ttl)


def key_digest(bearer: str) -> bytes:
    """What the cache is keyed by: a SHA-256 of the whole bearer key."""
    return hashlib.sha256(bearer.encode()).digest()


def authenticate_and_remember(sessions: sessionmaker[Session], cache: KeyCache, digest: bytes,
                              bearer: str) -> KeyInfo:
    """Check the key against Postgres (blocking); remember it when valid. InvalidKeyError else."""
    with sessions() as session:
        info = authenticate(session, bearer)
    cache.put(digest, info)
    return info
