"""API keys: generate, store as a hash, authenticate, list and revoke.

A key reads `rein_<key_id>_<secret>`:

- `key_id`: 12 lowercase hex digits, the public part: it is the row's primary key (so
  authentication is one lookup), and what `rein keys list` shows and `rein keys revoke` takes.
- `secret`: 43 characters of base62, about 256 random bits, shown once at creation.

Only SHA-256(secret) is stored. A slow password hash (bcrypt, scrypt, argon2) exists to
make guessing low-entropy passwords from a stolen hash expensive; a 256-bit random secret
cannot be guessed at any hashing speed, so a fast hash loses nothing and keeps per-request
authentication in microseconds.

Authentication compares the hash in constant time (hmac.compare_digest). A key id that
matches no row is compared against a dummy hash, and a revoked key's secret is checked
before it is refused, so an unknown id, a wrong secret and a revoked key take the same
path and the same time; only a caller who holds the right secret learns that it is revoked.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rein.store.tables import ApiKey

KEY_PREFIX = "rein_"
SCOPES = ("inference", "batch", "usage", "admin")   # admin: operating rein (GET /metrics)
_KEY_ID_LEN = 12
_SECRET_LEN = 43
_BASE62 = string.ascii_letters + string.digits
_KEY_RE = re.compile(rf"rein_([0-9a-f]{{{_KEY_ID_LEN}}})_([0-9A-Za-z]{{{_SECRET_LEN}}})")
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_MAX_NAME_LEN = 128

# Stands in for the stored hash when a key id is unknown; nothing hashes to it knowingly.
_DUMMY_HASH = hashlib.sha256(secrets.token_bytes(32)).digest()


class ApiKeyError(ValueError):
    """A key request rein cannot carry out; the message says why."""


class InvalidKeyError(ApiKeyError):
    """Authentication failed; the message is safe to show the caller."""


class KeyNotFoundError(ApiKeyError):
    pass


@dataclass(frozen=True)
class KeyInfo:
    """The public view of a key: everything but the secret and its hash."""

    key_id: str
    name: str
    tenant: str
    scopes: tuple[str, ...]
    rpm_limit: int | None
    tpm_limit: int | None
    created_at: datetime
    revoked_at: datetime | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def of(cls, row: ApiKey) -> KeyInfo:
        return cls(row.key_id, row.name, row.tenant, tuple(row.scopes), row.rpm_limit, row.tpm_limit,
                   row.created_at, row.revoked_at)


@dataclass(frozen=True)
class CreatedKey:
    info: KeyInfo
    key: str
    """The full key, secret included: show it once, store it nowhere."""


def generate_key() -> tuple[str, str]:
    """A fresh (key_id, secret)."""
    key_id = secrets.token_hex(_KEY_ID_LEN // 2)
    secret = "".join(secrets.choice(_BASE62) for _ in range(_SECRET_LEN))
    return key_id, secret


def format_key(key_id: str, secret: str) -> str:
    return f"{KEY_PREFIX}{key_id}_{secret}"


def parse_key(key: str) -> tuple[str, str] | None:
    """(key_id, secret) of a well-formed key, None otherwise."""
    match = _KEY_RE.fullmatch(key.strip())
    return (match.group(1), match.group(2)) if match else None


def hash_secret(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def secret_matches(secret: str, stored_hash: bytes | None) -> bool:
    """Constant-time check of secret against stored_hash; None (unknown key id) uses the dummy."""
    expected = _DUMMY_HASH if stored_hash is None else stored_hash
    return hmac.compare_digest(hash_secret(secret), expected) and stored_hash is not None


def parse_scopes(scopes: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """'inference,batch' -> ('inference', 'batch'); ValueError naming an unknown scope."""
    items = scopes.split(",") if isinstance(scopes, str) else list(scopes)
    result: list[str] = []
    for item in (s.strip() for s in items):
        if not item:
            continue
        if item not in SCOPES:
            raise ValueError(f"unknown scope {item!r}: use any of {', '.join(SCOPES)}")
        if item not in result:
            result.append(item)
    if not result:
        raise ValueError(f"a key needs at least one scope: any of {', '.join(SCOPES)}")
    return tuple(result)


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be a positive number of {'requests' if name == 'rpm' else 'tokens'} "
                         f"per minute, got {value} (leave it out for the default)")


def new_tenant_id() -> str:
    """A tenant name no other key has: `t-` and 12 random hex digits."""
    return f"t-{secrets.token_hex(6)}"


def create_key(session: Session, *, name: str, scopes: str | list[str] | tuple[str, ...],
               tenant: str | None = None, rpm: int | None = None, tpm: int | None = None) -> CreatedKey:
    """Add a key (flushed, not committed); the returned CreatedKey holds the only copy of the secret."""
    name = name.strip()
    if not name or len(name) > _MAX_NAME_LEN:
        raise ValueError(f"a key name must be 1 to {_MAX_NAME_LEN} characters, got {name!r}")
    # No tenant given: a tenant of its own, never one shared by accident with another key of
    # the same name (keys share a tenant, and so its jobs, files and usage, only when told to).
    tenant = new_tenant_id() if tenant is None else tenant.strip()
    if not _TENANT_RE.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r} must be 1 to 128 letters, digits or . _ @ - and start with a "
                         "letter or digit")
    scope_list = parse_scopes(scopes)
    _check_limit("rpm", rpm)
    _check_limit("tpm", tpm)
    for _ in range(5):   # 48-bit ids: a clash is rare, but the primary key would refuse it
        key_id, secret = generate_key()
        row = ApiKey(key_id=key_id, name=name, tenant=tenant, secret_hash=hash_secret(secret),
                     scopes=list(scope_list), rpm_limit=rpm, tpm_limit=tpm)
        try:
            with session.begin_nested():
                session.add(row)
        except IntegrityError:
            continue
        session.refresh(row)
        return CreatedKey(KeyInfo.of(row), format_key(key_id, secret))
    raise RuntimeError("could not find an unused key id in 5 tries")


def list_keys(session: Session, *, tenant: str | None = None, include_revoked: bool = True) -> list[KeyInfo]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.key_id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [KeyInfo.of(row) for row in session.scalars(query)]


def revoke_key(session: Session, key_id: str) -> KeyInfo:
    """Revoke a key by id (a full key is accepted too); revoking twice keeps the first time."""
    parsed = parse_key(key_id)
    key_id = parsed[0] if parsed else key_id.strip()
    row = session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        raise KeyNotFoundError(f"no API key with id {key_id!r} (see `rein keys list`)")
    if row.revoked_at is None:
        row.revoked_at = session.scalar(select(func.now()))
        session.flush()
    return KeyInfo.of(row)


def authenticate(session: Session, key: str) -> KeyInfo:
    """The key's KeyInfo when it is valid and not revoked; InvalidKeyError otherwise."""
    parsed = parse_key(key)
    if parsed is None:   # the format is public, so refusing early reveals nothing
        raise InvalidKeyError("invalid API key: expected 'rein_<key id>_<secret>'")
    key_id, secret = parsed
    row = session.get(ApiKey, key_id)
    if not secret_matches(secret, row.secret_hash if row is not None else None):
        raise InvalidKeyError("invalid API key")
    if row.revoked_at is not None:
        raise InvalidKeyError("this API key has been revoked")
    return KeyInfo.of(row)
