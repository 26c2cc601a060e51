"""Fairness between tenants when batches are fed to a model's queue: the order batches are
visited (`round_robin`) and how a tick's queue room is shared (`feeding_shares`). Plain
functions, so their rules are tested without a database.
"""

from __future__ import annotations

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
