"""How the batch manager shares a model's queue room between tenants and batches."""

from __future__ import annotations

from types import SimpleNamespace

from rein.batches.manager import feeding_shares, round_robin


def test_room_is_split_between_tenants_then_their_batches():
    shares = feeding_shares(10, [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1")])
    assert shares["b1"] == 5                       # b's half, though a has three batches
    assert sum(shares[b] for b in ("a1", "a2", "a3")) == 5
    assert shares["a1"] == 2 and shares["a2"] == 2 and shares["a3"] == 1   # remainder to the oldest
    assert sum(shares.values()) == 10


def test_no_room_no_lines_and_no_batches_no_shares():
    assert set(feeding_shares(0, [("a", "a1"), ("b", "b1")]).values()) == {0}
    assert feeding_shares(7, []) == {}


def test_batches_are_visited_round_robin_across_tenants_oldest_first():
    rows = [SimpleNamespace(id=i, tenant=t) for i, t in enumerate("aaab")]
    assert [row.id for row in round_robin(rows)] == [0, 3, 1, 2]
