"""The jobs a worker runs now: which task thread holds which lease, and which jobs were interrupted.

A task adds its job while it runs it (`tracking`). The cancel listener asks for the running
job ids, the lease keeper for the leases to renew, Celery's terminate (by thread) for the
job to interrupt, and a task whether its aborted job was interrupted (hand it back) rather
than cancelled (record it). The table only keeps the books: interrupting a job in the
engine is the worker context's (rein.worker.context).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rein.jobs.claim import Lease


class JobTable:
    """Thread-safe; `stopping` (the worker's) reads as every job interrupted."""

    def __init__(self, stopping: threading.Event) -> None:
        self.stopping = stopping
        self._lock = threading.Lock()
        self._by_thread: dict[int, Lease] = {}
        self._interrupted: set[str] = set()

    @contextmanager
    def tracking(self, lease: Lease) -> Iterator[None]:
        """While the calling task thread runs the leased job."""
        ident = threading.get_ident()
        with self._lock:
            self._by_thread[ident] = lease
        try:
            yield
        finally:
            with self._lock:
                self._by_thread.pop(ident, None)
                self._interrupted.discard(lease.job_id)

    def running_jobs(self) -> list[str]:
        with self._lock:
            return [lease.job_id for lease in self._by_thread.values()]

    def held_leases(self) -> list[Lease]:
        with self._lock:
            return list(self._by_thread.values())

    def lease_of_thread(self, ident: int) -> Lease | None:
        with self._lock:
            return self._by_thread.get(ident)

    def mark_interrupted(self, job_id: str) -> None:
        with self._lock:
            self._interrupted.add(job_id)

    def is_interrupted(self, job_id: str) -> bool:
        with self._lock:
            return self.stopping.is_set() or job_id in self._interrupted
