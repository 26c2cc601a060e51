"""Finding a poison job without running everything alone: who was in an engine when it died,
how those suspects are split, and which suspects may share an engine.

A request can kill its engine (a crash in native code, an out-of-memory only it causes). One
death does not say which of the jobs present did it, so the worker narrows it down by halving:

* **Evidence.** Only an engine that died under a live worker counts (rein.worker.engine_keeper):
  the worker knows exactly which jobs were in it (`EngineRoster`: the jobs submitted to that
  engine and not finished by its last step). A worker that vanished whole (SIGKILL, the machine
  lost) is no evidence against the jobs it held: it took all of them down at once, whatever
  they were. The reaper queues those again with their attempts refunded and counts no death
  (rein.jobs.reaper).
* **Splitting.** At a death the jobs present are sorted by the suspect group each came in with
  (none for a job that was not a suspect) and each such part is cut in two halves by job id
  (`split_suspects`). Every job present becomes a suspect of its half: handed back with
  `deaths_seen` + 1, `suspect_group` and `suspect_group_size` (the half's size) stored with the
  job (rein.jobs.claim.release_job), so the evidence survives any process. A poison job's group
  thus halves at each death it causes, whatever ran beside it.
* **Running suspects.** `SuspectGate`: jobs that are not suspects run as before; a suspect runs
  beside them and beside its own group, never beside another group (so a death narrows one
  group, and innocent groups are not dragged into it); a suspect whose group is itself alone
  runs alone (the others wait, as before this module every suspect did).
* **The verdict.** A job is failed as the cause (`crashes_its_worker`) only when the evidence
  isolates it: it was alone in its engine when the engine died, and had been present at an
  earlier death too (`EngineDeath.isolates`). A job that happened to be alone at a single
  unrelated crash is only a suspect of one, run alone once more.

A poison job among N present at its first death is failed after at most about log2(N) + 1
deaths (N halves to one, which then dies alone: 7 for 64), each refunded to every job present. The other jobs
run in groups side by side, one engine restart per death; before, each ran alone after the
first death, one after another, and the worker's other jobs waited behind each.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rein.engine.step_outputs import RequestOutput
    from rein.jobs.claim import Lease


@dataclass(frozen=True)
class Suspicion:
    """A job's suspect group after a death, and how many jobs share it (1: it runs alone)."""

    group: str
    size: int


def split_suspects(death_id: str, present: Mapping[str, str | None]) -> dict[str, Suspicion]:
    """The new suspect group of each job present at death `death_id` (`present`: job id -> the
    group it came in with, None for none): each prior group's part, and the part of jobs that
    were no suspects, cut in two halves by job id (the first half the larger)."""
    parts: dict[str | None, list[str]] = {}
    for job_id, group in present.items():
        parts.setdefault(group, []).append(job_id)
    split: dict[str, Suspicion] = {}
    for n, (_, job_ids) in enumerate(sorted(parts.items(), key=lambda part: part[0] or "")):
        job_ids.sort()
        cut = (len(job_ids) + 1) // 2
        for half, members in enumerate((job_ids[:cut], job_ids[cut:])):
            for job_id in members:
                split[job_id] = Suspicion(f"{death_id}.{n}.{half}", len(members))
    return split


@dataclass(frozen=True)
class EngineDeath:
    """Who was in an engine when it died: each job present, with the group it came in with."""

    death_id: str
    present: Mapping[str, str | None]
    suspicions: Mapping[str, Suspicion] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "suspicions", split_suspects(self.death_id, self.present))

    def isolates(self, lease: Lease) -> bool:
        """Whether this death names the leased job as the cause: alone in the engine, having
        died before (module docstring)."""
        return set(self.present) == {lease.job_id} and lease.deaths_seen >= 1

    def suspicion_of(self, job_id: str) -> Suspicion:
        return self.suspicions.get(job_id) or Suspicion(f"{self.death_id}.alone.{job_id}", 1)


@dataclass
class _Boarding:
    present: dict[str, str | None] = field(default_factory=dict)
    aboard: int = 0
    death: EngineDeath | None = None


class EngineRoster:
    """The jobs in each engine (runner) of the worker now; at its death, who was present.

    A task is `aboard` from just before it submits its job until it is done with it; the
    engine's steps (`step`, an on_step hook) take finished jobs out at once, so a job that
    ended in the step before the death is not counted present. The first task to ask for
    the `death` of a runner fixes the record that all its jobs then share. Counting a job
    present that was not (one still being submitted) can only delay a verdict, never
    blame a job wrongly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boardings: dict[Any, _Boarding] = {}

    @contextmanager
    def aboard(self, runner: Any, lease: Lease) -> Iterator[None]:
        with self._lock:
            boarding = self._boardings.setdefault(runner, _Boarding())
            boarding.aboard += 1
            if boarding.death is None:
                boarding.present[lease.job_id] = lease.suspect_group
        try:
            yield
        finally:
            with self._lock:
                boarding.aboard -= 1
                if boarding.death is None:
                    boarding.present.pop(lease.job_id, None)
                if not boarding.aboard:
                    self._boardings.pop(runner, None)

    def step(self, outputs: Iterable[RequestOutput]) -> None:
        finished = [output.request_id for output in outputs if output.finished]
        if not finished:
            return
        with self._lock:
            for boarding in self._boardings.values():
                if boarding.death is None:
                    for job_id in finished:
                        boarding.present.pop(job_id, None)

    def death(self, runner: Any) -> EngineDeath:
        """The record of `runner`'s death (asked by a task aboard it, after the engine died)."""
        with self._lock:
            boarding = self._boardings.setdefault(runner, _Boarding())
            if boarding.death is None:
                boarding.death = EngineDeath(secrets.token_hex(6), dict(boarding.present))
            return boarding.death


class SuspectGate:
    """Which claimed jobs share the engine (module docstring): any number that are no suspects,
    with the members of one suspect group at most; a suspect of a group of one alone. A job
    waiting to run alone stops new entries (so it is not starved) and waits for the engine
    to empty."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._group: str | None = None
        self._group_inside = 0
        self._alone = False
        self._alone_waiting = 0

    @contextmanager
    def admit(self, group: str | None, size: int | None) -> Iterator[None]:
        """While the job of suspect `group` (of `size` jobs; None: no suspect) runs."""
        if group is not None and (size or 1) <= 1:
            with self._alone_inside():
                yield
            return
        with self._cond:
            while self._alone or self._alone_waiting or (group is not None and self._group not in (None, group)):
                self._cond.wait()
            self._inside += 1
            if group is not None:
                self._group = group
                self._group_inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                if group is not None:
                    self._group_inside -= 1
                    if not self._group_inside:
                        self._group = None
                self._cond.notify_all()

    @contextmanager
    def _alone_inside(self) -> Iterator[None]:
        with self._cond:
            self._alone_waiting += 1
            try:
                while self._alone or self._inside:
                    self._cond.wait()
            finally:
                self._alone_waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
