"""How the batch manager shares a model's queue room between tenants and batches."""

from __future__ import annotations

from types import SimpleNamespace

from rein.batches.fairness import feeding_shares, round_robin


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


def test_one_tenants_batches_take_at_most_its_share_of_the_validator_threads(monkeypatch):
    """Two validator threads: tenant a's three batches validate one at a time, and b's batch
    starts beside a's first rather than after all of a's."""
    import threading

    from support import wait_for

    from rein.batches.manager import BatchManager
    from rein.core.settings import Settings

    manager = BatchManager(Settings(batch_validator_threads=2), None, None, None, None, None)
    release = threading.Event()
    started: list[str] = []

    def advance(batch_id, shares=None):
        started.append(batch_id)
        release.wait(10)

    monkeypatch.setattr(manager, "advance", advance)
    monkeypatch.setattr(manager, "wake", lambda: None)
    try:
        for batch_id, tenant in (("a1", "a"), ("a2", "a"), ("a3", "a"), ("b1", "b")):
            manager._validate_in_background(batch_id, tenant)
        wait_for(lambda: len(started) == 2, 10, "two validations to start")
        assert sorted(started) == ["a1", "b1"] and set(manager._validating) == {"a1", "b1"}
        release.set()
        wait_for(lambda: not manager._validating, 10, "the validations to end")
        manager._validate_in_background("a2", "a")     # the next tick: a's next batch now
        wait_for(lambda: "a2" in started, 10, "a's next batch")
    finally:
        release.set()
        manager._validator.shutdown(wait=True)


def test_lines_within_tokens_sends_while_room_is_left():
    from rein.batches.fairness import lines_within_tokens

    assert lines_within_tokens([100, 100, 100, 100], 250) == 3     # the third passes the cap
    assert lines_within_tokens([100, 100], 0) == 0 and lines_within_tokens([100], -5) == 0
    assert lines_within_tokens([5000], 1) == 1                      # larger than the cap: alone
    assert lines_within_tokens([100, 100], None) == 2               # no cap
