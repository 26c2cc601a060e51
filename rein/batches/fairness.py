"""Fairness between tenants when batches are fed to a model's queue: the order batches are
visited (`round_robin`), how a tick's queue room is shared (`feeding_shares`), and how many
lines a tenant under its cap on queued batch tokens may send (`lines_within_tokens`). Plain
functions, so their rules are tested without a database.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def round_robin(rows: list[Any]) -> list[Any]:
    """Batches (rows with `tenant`), oldest first, interleaved across tenants: each tenant's
    oldest, then each tenant's second, ..."""
    by_tenant: dict[str, list[Any]] = {}
    for row in rows:
        by_tenant.setdefault(row.tenant, []).append(row)
    order = []
    for rank in range(max((len(v) for v in by_tenant.values()), default=0)):
        order += [batches[rank] for batches in by_tenant.values() if rank < len(batches)]
    return order


def feeding_shares(room: int, batches: list[tuple[str, str]]) -> dict[str, int]:
    """Split `room` queue places between (tenant, batch id)s: evenly between tenants, then
    evenly between each tenant's batches, the remainder to the first (oldest) ones. A batch
    with fewer lines left than its share leaves the rest unused until the next tick."""
    by_tenant: dict[str, list[str]] = {}
    for tenant, batch_id in batches:
        by_tenant.setdefault(tenant, []).append(batch_id)
    shares: dict[str, int] = {}
    for t, (_, ids) in enumerate(by_tenant.items()):
        tenant_room = room // len(by_tenant) + (1 if t < room % len(by_tenant) else 0)
        for b, batch_id in enumerate(ids):
            shares[batch_id] = tenant_room // len(ids) + (1 if b < tenant_room % len(ids) else 0)
    return shares


def lines_within_tokens(tokens: Sequence[int], room: int | None) -> int:
    """How many of these lines (their tokens, in sending order) a tenant with `room` tokens left
    under its cap on queued batch tokens may send now: lines while some room is left, so the
    last one may pass the cap (a line larger than the whole cap still goes, when nothing else
    of its tenant's is queued); none when no room is left; all of them when there is no cap (None)."""
    if room is None:
        return len(tokens)
    count = 0
    for line_tokens in tokens:
        if room <= 0:
            break
        room -= line_tokens
        count += 1
    return count
