"""Group commit: many callers' small Postgres writes, written together.

Each caller brings one item (a job to claim, a finished job to record, a request to admit
and store) and wants its own answer. While a group is being written, the items that arrive
wait; the next writer takes every item waiting (up to `max_group`), writes them in one
statement (`write_many`) and answers each caller. An item that finds nothing being written
goes at once, as it would without grouping (through `write_one` when there is one); under
load the fixed costs of a write (a round trip, a connection checkout, a commit, the Redis
calls around it) are paid once per group rather than once per item.

Who writes a group:

* `call(item)`, from a thread that may block (a worker's task threads claiming and recording
  jobs): the caller that finds nothing being written writes the group itself, its own item
  first, then hands the lead to the first item still waiting, whose caller writes the next.
  A caller alone pays no hand-off to another thread.
* `submit(item)`, from an event loop that must not block (the API's intake): a Future; the
  group commit's own thread (`start()`, `stop()`) writes these items' groups.

Answers and errors, the same for both: `write_many(items)` returns the answers in the items'
order, and an exception in an item's place is raised to that item's caller alone. When the
write itself raises, a lost connection (`OperationalError`, `InterfaceError`) fails every
caller of the group, each of which retries as it would alone; another error, where there is
a `write_one`, has the group written again one item at a time, so one bad item fails only
its own caller (without one, every caller gets the error). Items with the same `key` never
share a group (the second waits for the next one), so a statement never names one job
twice. A submitted item whose Future was cancelled while it waited (its client went away)
is not written.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Answer = TypeVar("Answer")


class GroupCommit(Generic[Item, Answer]):
    """`call(item)` from many threads, or `submit(item)` once started; see the module docstring.

    `write_many(items)`: the answers, in the items' order (an exception in an item's place
    is raised to its caller alone). `write_one(item)`: an item written alone, and the
    fallback when a group's write fails for another reason than a lost connection.
    `key(item)`: items with equal keys never share a group.
    """

    def __init__(self, write_many: Callable[[list[Item]], Sequence[Answer | BaseException]], *,
                 write_one: Callable[[Item], Answer] | None = None, key: Callable[[Item], Hashable] | None = None,
                 max_group: int = 64, what: str = "items", thread_name: str = "rein-group-commit") -> None:
        self.write_many = write_many
        self.write_one = write_one
        self.key = key
        self.max_group = max_group
        self.what = what
        self.thread_name = thread_name
        self._lock = threading.Lock()
        self._waiting: deque[_Pending] = deque()   # in arrival order; the first is the next writer's
        # Someone holds the lead: a caller or the thread writes a group, or is about to. Items
        # wait only while it is held, so the one who leaves it with items waiting hands it on.
        self._writing = False
        self._thread_leads = False                 # the one holding the lead is the thread
        self._lead_changed = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.statements = 0                        # write_many calls made (for tests and benchmarks)

    # -- callers that may block: the caller writes ------------------------------------------

    def call(self, item: Item) -> Answer:
        """Write `item` with whatever else waits; its answer, or its error raised."""
        pending = _Pending(item, woken=threading.Event())
        with self._lock:
            self._waiting.append(pending)
            leading = not self._writing
            self._writing = True
        if not leading:
            pending.woken.wait()   # answered, or handed the lead
            if pending.future.done():
                return pending.future.result()
        try:   # this thread writes: its own item is the first waiting
            self._write(self._take_group())
        finally:
            self._hand_on()
        return pending.future.result()

    # -- callers that must not block: the thread writes --------------------------------------

    def start(self) -> GroupCommit[Item, Answer]:
        """Start the thread that writes the submitted items."""
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def submit(self, item: Item) -> Future[Answer]:
        """A Future of `item`'s answer (or error), written by the thread with whatever else waits."""
        pending = _Pending(item)
        with self._lock:
            if self._thread is None or self._stopping:
                raise RuntimeError(f"no more {self.what} are taken: "
                                   + ("shutting down" if self._stopping else "start() was not called"))
            self._waiting.append(pending)
            if not self._writing:
                self._writing = self._thread_leads = True
                self._lead_changed.notify_all()
        return pending.future

    def stop(self, timeout: float = 10.0) -> None:
        """Write what is waiting, then end the thread; later submissions are refused."""
        with self._lock:
            self._stopping = True
            self._lead_changed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._thread_leads and not (self._stopping and not self._writing):
                    self._lead_changed.wait()
                if not self._thread_leads:
                    return   # stopping, and nothing waits
            while True:   # it writes as long as items wait: it has no answer of its own to return
                try:
                    self._write(self._take_group())
                except Exception:   # _write has answered every item; keep the thread for the next groups
                    log.exception("group commit of %s", self.what)
                with self._lock:
                    if not self._waiting:
                        self._writing = self._thread_leads = False
                        self._lead_changed.notify_all()
                        break

    # -- both ---------------------------------------------------------------------------------

    def _hand_on(self) -> None:
        """After a caller's group: the lead goes to the first item waiting (its caller, or the
        thread for a submitted one), or is let go."""
        with self._lock:
            following = self._waiting[0] if self._waiting else None
            self._writing = following is not None
            if following is not None and following.woken is None:
                self._thread_leads = True
            self._lead_changed.notify_all()
        if following is not None and following.woken is not None:
            following.woken.set()

    def _take_group(self) -> list[_Pending]:
        """The next group, taken off the waiting list: in arrival order, distinct keys, at
        most max_group; a cancelled submission is dropped."""
        with self._lock:
            group: list[_Pending] = []
            keys: set[Hashable] = set()
            left: deque[_Pending] = deque()
            while self._waiting and len(group) < self.max_group:
                pending = self._waiting.popleft()
                key = self.key(pending.item) if self.key is not None else None
                if key is not None and key in keys:
                    left.append(pending)
                elif pending.future.set_running_or_notify_cancel():
                    group.append(pending)
                    keys.add(key)
            left.extend(self._waiting)
            self._waiting = left
        return group

    def _write(self, group: list[_Pending]) -> None:
        """Write the group and answer each of its items (see the module docstring)."""
        if not group:
            return
        answers: Sequence[Any]
        try:
            try:
                if len(group) == 1 and self.write_one is not None:
                    answers = [self.write_one(group[0].item)]
                else:
                    self.statements += 1
                    answers = self.write_many([pending.item for pending in group])
                    if len(answers) != len(group):
                        raise RuntimeError(f"{len(answers)} answers for {len(group)} {self.what}")
            except (OperationalError, InterfaceError) as exc:   # Postgres away: every caller retries
                if self.write_one is None:
                    log.error("could not write %d %s: %s", len(group), self.what, exc)
                answers = [exc] * len(group)
            except Exception as exc:
                if self.write_one is None or len(group) == 1:
                    if self.write_one is None:
                        log.error("could not write %d %s: %s", len(group), self.what, exc)
                    answers = [exc] * len(group)
                else:
                    log.warning("writing %d %s together failed (%s: %s); writing them one by one",
                                len(group), self.what, type(exc).__name__, exc)
                    answers = [_answer_alone(self.write_one, pending.item) for pending in group]
            for pending, answer in zip(group, answers, strict=True):
                if isinstance(answer, BaseException):
                    pending.future.set_exception(answer)
                else:
                    pending.future.set_result(answer)
        finally:
            for pending in group:
                if not pending.future.done():   # only when something above raised past `except Exception`
                    pending.future.set_exception(RuntimeError(f"the group commit of {self.what} was interrupted"))
                if pending.woken is not None:
                    pending.woken.set()


def _answer_alone(write_one: Callable[[Any], Any], item: Any) -> Any:
    """`write_one(item)`'s answer, or the exception it raised."""
    try:
        return write_one(item)
    except Exception as exc:
        return exc


@dataclass(eq=False)
class _Pending:
    item: Any
    woken: threading.Event | None = None   # a caller's (call): set when answered or handed the lead
    future: Future = field(default_factory=Future)
