"""The lease keeper: renews the leases of the jobs a worker runs, and stops a job whose lease is lost.

Every `Settings.lease_renew_seconds` it renews all the leases of the job table in one
statement (rein.jobs.claim.renew_leases). After a failure (Postgres away) it tries again
every LEASE_RETRY_SECONDS, so the leases are renewed as soon as Postgres is back, before the
reaper takes them. A job whose lease it finds lost (the reaper gave it to another attempt
after this worker could not renew in time) is handed to `on_lost`, which aborts it: whatever
it computes can no longer be recorded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.core.logging import log_context
from rein.jobs.claim import Lease, renew_leases
from rein.worker.job_table import JobTable

log = logging.getLogger(__name__)

# After a failed lease renewal, try again this often.
LEASE_RETRY_SECONDS = 1.0


class LeaseKeeper:
    """Renews `jobs`' leases until `stopping` is set (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], worker_name: str, model_name: str, jobs: JobTable,
                 on_lost: Callable[[Lease], None], stopping: threading.Event, *, renew_seconds: float,
                 lease_seconds: float) -> None:
        self.sessions = sessions
        self.worker_name = worker_name
        self.model_name = model_name
        self.jobs = jobs
        self.on_lost = on_lost
        self.stopping = stopping
        self.renew_seconds = renew_seconds
        self.lease_seconds = lease_seconds
        self._thread = threading.Thread(target=self._run, name="rein-lease-keeper", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        interval = self.renew_seconds
        while not self.stopping.wait(interval):
            leases = self.jobs.held_leases()
            try:
                held = renew_leases(self.sessions, self.worker_name, leases, self.lease_seconds)
            except SQLAlchemyError as exc:
                log.warning("cannot renew the leases of %d running jobs: %s", len(leases), exc)
                interval = LEASE_RETRY_SECONDS
                continue
            interval = self.renew_seconds
            still_running = {(lease.job_id, lease.attempt) for lease in self.jobs.held_leases()}
            for lease in leases:
                key = (lease.job_id, lease.attempt)
                if key not in held and key in still_running:
                    with log_context(job_id=lease.job_id, model=self.model_name, worker=self.worker_name):
                        log.warning("job %s attempt %d: lease lost (not renewed in time); stopping it",
                                    lease.job_id, lease.attempt)
                    self.on_lost(lease)
