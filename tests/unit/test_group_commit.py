"""The group commit (rein.jobs.group_commit), on its own: write functions that record their
groups stand in for Postgres. Its users' statements are tested where they are written:
the claims and records in tests/integration/test_worker.py, the intake's commit in
tests/integration/api/test_intake_group_commit.py.
"""

from __future__ import annotations

import threading
import time

import pytest
from sqlalchemy.exc import OperationalError

from rein.jobs.group_commit import GroupCommit


class Writes:
    """`write_many` and `write_one` that record what they wrote; the first write waits until
    `release` (so the items that come meanwhile wait, and go as a group). A negative item is
    refused (an exception in its place); `fail` makes the next write_many raise it."""

    def __init__(self) -> None:
        self.groups: list[list[int]] = []
        self.alone: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail: Exception | None = None

    def _first(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(10)

    def many(self, items: list[int]) -> list[object]:
        self._first()
        self.groups.append(list(items))
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        return [ValueError(f"refused {i}") if i < 0 else ("ok", i) for i in items]

    def one(self, item: int) -> tuple[str, int]:
        self._first()
        self.alone.append(item)
        if item < 0:
            raise ValueError(f"refused {item}")
        return ("ok", item)


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def call_while_the_first_writes(group: GroupCommit, writes: Writes, items: list[int]) -> dict[int, object]:
    """`group.call(item)` on a thread per item, the first writer held up until the others
    all wait; each item's answer (or the exception raised to its caller)."""
    answers: dict[int, object] = {}

    def call(index: int) -> None:
        try:
            answers[index] = group.call(items[index])
        except Exception as exc:
            answers[index] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(items))]
    threads[0].start()
    assert writes.entered.wait(10)
    for waiting, thread in enumerate(threads[1:], 1):   # one at a time: they wait in this order
        thread.start()
        wait_for(lambda n=waiting: len(group._waiting) == n, "the call to wait")
    writes.release.set()
    for thread in threads:
        thread.join(10)
    assert not group._writing and not group._waiting
    return answers


def test_a_caller_alone_writes_at_once_on_its_own_thread():
    writes = Writes()
    writes.release.set()
    group = GroupCommit(writes.many, write_one=writes.one)
    assert group.call(3) == ("ok", 3)
    assert (writes.alone, writes.groups, group.statements) == ([3], [], 0)
    assert GroupCommit(writes.many).call(4) == ("ok", 4)   # no write_one: a group of one
    assert writes.groups == [[4]]


def test_calls_that_wait_go_together_each_answered_and_a_key_never_twice_in_a_group():
    writes = Writes()
    group = GroupCommit(writes.many, write_one=writes.one, key=abs)
    items = [1, 2, -3, 2, 4]   # -3: refused, alone; the second 2 waits for the next group
    answers = call_while_the_first_writes(group, writes, items)
    assert writes.alone == [1, 2] and writes.groups == [[2, -3, 4]] and group.statements == 1
    assert [answers[i] for i in (0, 1, 3, 4)] == [("ok", 1), ("ok", 2), ("ok", 2), ("ok", 4)]
    assert isinstance(answers[2], ValueError) and "refused -3" in str(answers[2])


def test_a_group_that_fails_is_written_one_by_one_so_one_bad_item_fails_alone():
    writes = Writes()
    writes.fail = RuntimeError("one row is refused")
    group = GroupCommit(writes.many, write_one=writes.one)
    answers = call_while_the_first_writes(group, writes, [1, 2, -3, 4])
    assert writes.groups == [[2, -3, 4]] and writes.alone == [1, 2, -3, 4]
    assert [answers[i] for i in (0, 1, 3)] == [("ok", 1), ("ok", 2), ("ok", 4)]
    assert isinstance(answers[2], ValueError)


def test_a_lost_connection_fails_every_caller_of_the_group_without_writing_them_alone():
    writes = Writes()
    writes.fail = OperationalError("UPDATE jobs", {}, ConnectionRefusedError("Postgres is down"))
    group = GroupCommit(writes.many, write_one=writes.one)
    answers = call_while_the_first_writes(group, writes, [1, 2, 3])
    assert writes.alone == [1] and writes.groups == [[2, 3]]
    assert answers[0] == ("ok", 1) and all(isinstance(answers[i], OperationalError) for i in (1, 2))


def test_submissions_arriving_during_a_write_go_together_in_the_next():
    writes = Writes()
    group = GroupCommit(writes.many, max_group=5).start()
    try:
        first = group.submit(0)
        assert writes.entered.wait(5)
        later = [group.submit(i) for i in (1, 2, 3, 4, 5, 6, -7)]
        writes.release.set()
        assert first.result(5) == ("ok", 0)
        assert [f.result(5) for f in later[:6]] == [("ok", i) for i in (1, 2, 3, 4, 5, 6)]
        with pytest.raises(ValueError, match="refused -7"):
            later[-1].result(5)
    finally:
        group.stop()
    # Alone, the first went at once; the seven that waited went in groups of at most 5.
    assert writes.groups == [[0], [1, 2, 3, 4, 5], [6, -7]]


def test_a_cancelled_submission_is_not_written_and_a_failing_write_fails_its_group():
    writes = Writes()
    group = GroupCommit(writes.many).start()
    try:
        first = group.submit(0)
        assert writes.entered.wait(5)
        cancelled, kept = group.submit(1), group.submit(2)
        assert cancelled.cancel()
        writes.release.set()
        assert kept.result(5) == ("ok", 2)
        assert first.result(5) == ("ok", 0)
    finally:
        group.stop()
    assert writes.groups == [[0], [2]]

    def broken(items):
        raise ConnectionError("postgres is down")

    group = GroupCommit(broken).start()
    try:
        futures = [group.submit(i) for i in range(3)]
        for future in futures:
            with pytest.raises(ConnectionError, match="postgres is down"):
                future.result(5)
    finally:
        group.stop()
    with pytest.raises(RuntimeError, match="shutting down"):
        group.submit(9)


def test_stop_writes_what_waits_first():
    writes = Writes()
    group = GroupCommit(writes.many).start()
    first = group.submit(0)
    assert writes.entered.wait(5)
    waiting = [group.submit(i) for i in (1, 2)]
    stopper = threading.Thread(target=group.stop)
    stopper.start()
    writes.release.set()
    stopper.join(10)
    assert [f.result(0) for f in (first, *waiting)] == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert writes.groups == [[0], [1, 2]] and not group._thread.is_alive()
