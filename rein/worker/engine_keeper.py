"""A worker's engine, kept alive: a dead engine is noticed and replaced, and the jobs it died
under come back as suspects.

The engine runs in a child process (rein.engine.process_client). The kernel's OOM killer, a
crash in native code or a request that breaks it can end that process while the worker lives
on. Before this module, such a worker went on taking jobs and handing each back from a
dead engine until every job it saw had spent its attempts. Now:

* `EngineKeeper` looks at the runner twice a second. When it has died, the keeper clears
  `WorkerContext.engine_ready` (tasks wait for it before claiming, so nothing is claimed that
  cannot run; the heartbeat says `down`), then builds a new runner, retrying with a backoff
  (1 s doubling to 60 s) while the model cannot load, and sets `engine_ready` again.
  Replacing the engine in place, rather than exiting for a supervisor to restart the worker,
  keeps the worker's Celery connection, its threads and their messages, and works the same
  under compose, systemd or a bare `rein worker`.
* The jobs that were running get EngineStoppedError and are handed back with their attempt
  refunded. A death under a live worker is evidence: the worker knows exactly which jobs
  were in the engine, and those become suspects, split in halves (rein.worker.suspects). A
  suspect's next attempt runs only beside jobs that are no suspects and its own half, so a
  request that kills the engine is narrowed down death by death and failed once it died
  alone, without running every job present alone and without charging anyone an attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rein.engine.client import EngineClient
    from rein.worker.context import WorkerContext

log = logging.getLogger(__name__)

CHECK_SECONDS = 0.5
FIRST_RETRY_SECONDS = 1.0
MAX_RETRY_SECONDS = 60.0


class EngineKeeper:
    """Replaces the context's runner when it dies (see the module docstring). `make_runner`
    builds and starts a new runner (raising when the engine cannot load)."""

    def __init__(self, context: WorkerContext, make_runner: Callable[[], EngineClient]) -> None:
        self.context = context
        self.make_runner = make_runner
        self.replacements = 0
        self._thread = threading.Thread(target=self._watch, name="rein-engine-keeper", daemon=True)

    def start(self) -> EngineKeeper:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _watch(self) -> None:
        stopping = self.context.stopping
        while not stopping.wait(CHECK_SECONDS):
            if not self.context.runner.alive and not stopping.is_set():
                self._replace()
            elif not self.context.engine_ready.is_set() and not stopping.is_set():
                self.context.engine_ready.set()   # a task saw the runner dead in its last moments

    def _replace(self) -> None:
        context = self.context
        context.engine_ready.clear()
        log.error("the engine of %s died; its running jobs go back to the queue (attempts refunded) and a "
                  "new engine is starting", context.model_name)
        delay = FIRST_RETRY_SECONDS
        while not context.stopping.is_set():
            try:
                runner = self.make_runner()
            except Exception as exc:  # noqa: BLE001 - any failure to load: retry later
                log.error("a new engine for %s did not start (%s); retrying in %.0f s", context.model_name,
                          exc, delay)
                context.stopping.wait(delay)
                delay = min(delay * 2, MAX_RETRY_SECONDS)
                continue
            context.runner = runner
            if context.stopping.is_set():   # context.stop() may have stopped the old one meanwhile
                runner.stop()
                return
            if context.metrics is not None:
                context.metrics.attach(runner.engine)
            self.replacements += 1
            context.engine_ready.set()
            log.info("a new engine for %s is ready (replacement %d)", context.model_name, self.replacements)
            return
