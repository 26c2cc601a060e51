"""Group commit for the task threads' single-statement writes (the claim, the record).

Many task threads each make one short Postgres statement per job. `GroupCommit` lets them
share round trips: while one thread writes, the calls that other threads bring meanwhile
wait, and the next writer (the first of them) writes them all in one statement, up to
`max_group` at once. A thread alone pays one statement, as before; when jobs start or end
together (a batch's lines), they share a round trip, a connection checkout and a commit.

Each caller gets its own answer or error, as from the single-item call: a group that fails
for another reason than a lost connection (`OperationalError`, `InterfaceError`: every
caller gets that, and retries as it would alone) is written again one item at a time, so
one bad item fails only its own caller. Items with the same key never share a group (the
second waits for the next one), so a statement never names one job twice.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class GroupCommit(Generic[Item, Answer]):
    """`call(item)` from many threads; `write_one(item)` alone, or `write_many(items)` (the
    answers in the items' order; an exception in an item's place is raised to its caller
    alone) for the items that waited together."""

    def __init__(self, write_one: Callable[[Item], Answer], write_many: Callable[[list[Item]], list[Answer]],
                 key: Callable[[Item], Hashable], max_group: int = 64, what: str = "items") -> None:
        self.write_one = write_one
        self.write_many = write_many
        self.key = key
        self.max_group = max_group
        self.what = what
        self._lock = threading.Lock()
        self._waiting: list[_Pending] = []   # in arrival order; the first is the next writer's
        self._writing = False
        self.statements = 0                  # group statements made (for tests and benchmarks)

    def call(self, item: Item) -> Answer:
        pending = _Pending(item)
        with self._lock:
            self._waiting.append(pending)
            leading = not self._writing
            self._writing = True
        if not leading:
            pending.ready.wait()
            if not pending.leading:
                return pending.answer()
        with self._lock:   # this thread writes: its own item is the first waiting
            group, keys, left = [], set(), []
            for waiting in self._waiting:
                key = self.key(waiting.item)
                if len(group) < self.max_group and key not in keys:
                    group.append(waiting)
                    keys.add(key)
                else:
                    left.append(waiting)
            self._waiting = left
        try:
            self._write(group)
        finally:
            with self._lock:
                following = self._waiting[0] if self._waiting else None
                self._writing = following is not None
            for done in group:
                if done is not pending:
                    done.ready.set()
            if following is not None:
                following.leading = True
                following.ready.set()
        return pending.answer()

    def _write(self, group: list[_Pending]) -> None:
        try:
            if len(group) == 1:
                group[0].result = self.write_one(group[0].item)
                return
            self.statements += 1
            for pending, result in zip(group, self.write_many([p.item for p in group]), strict=True):
                if isinstance(result, BaseException):   # that item's own failure
                    pending.error = result
                else:
                    pending.result = result
        except (OperationalError, InterfaceError) as exc:   # Postgres away: every caller retries
            for pending in group:
                pending.error = exc
        except Exception as exc:
            if len(group) == 1:
                group[0].error = exc
                return
            log.warning("writing %d %s together failed (%s: %s); writing them one by one",
                        len(group), self.what, type(exc).__name__, exc)
            for pending in group:
                try:
                    pending.result = self.write_one(pending.item)
                except Exception as one:
                    pending.error = one


@dataclass(eq=False)
class _Pending:
    item: Any
    ready: threading.Event = field(default_factory=threading.Event)
    leading: bool = False           # woken to write the next group, not with an answer
    result: Any = None
    error: BaseException | None = None

    def answer(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result
