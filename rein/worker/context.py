"""The worker's long-lived half: the engine and its runner, the token publisher, the
cancel listener, the heartbeat, the lease keeper and a reaper, wired into one `WorkerContext`
that a Celery bootstep (rein.worker.bootstep) builds at start and stops at shutdown.

The engine steps in a child process of its own (rein.engine.process_client, unless
`Settings.worker_engine_process` is off or a test hands in an engine factory): the runner
here keeps the request streams, and the heartbeat and metrics read its view of the engine.
With `Settings.worker_engine_cpus` the engine process keeps to those cores and the worker's
threads to the others (rein.core.cpu_pinning).

`WorkerContext` owns and wires the parts, each in a module of its own: the job table (which
task runs which leased job, rein.worker.job_table), the heartbeat (rein.worker.heartbeat),
the lease keeper (rein.worker.leases: a job whose lease it finds lost is interrupted here),
the engine keeper (rein.worker.engine_keeper), the cancel listener, the group claimer and
recorder, and the reaper (rein.jobs.reaper), which runs in every worker, so a deployment
recovers a dead worker's jobs as long as one worker lives.

`WorkerSpec` says what to build (the model served, its engine configuration); `build_context`
builds and starts it. Stopping closes the publisher, stops the runner (aborting whatever the
engine still runs) and so ends every task promptly: each hands its job back for another
worker (rein.jobs.claim.release_job) instead of keeping the warm shutdown waiting for the
longest job.

Tasks reach all of this through `worker_context(app)`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from celery import Celery
from redis import Redis
from sqlalchemy.orm import Session, sessionmaker

from rein.batches.wakeup import announce_batch_progress
from rein.core.cpu_pinning import check_engine_cpus, format_cpus, keep_worker_off
from rein.core.logging import configured_elsewhere, log_context
from rein.jobs.claim import GroupClaimer
from rein.jobs.queues import interactive_slots, queued_slots
from rein.jobs.reaper import Reaper
from rein.store.db import make_engine
from rein.store.filestore import FileStore, filestore_for
from rein.store.redis_client import redis_client
from rein.store.redis_keys import RedisKeys
from rein.worker.adapters import AdapterListener
from rein.worker.cancel import CancelListener
from rein.worker.engine_keeper import EngineKeeper
from rein.worker.heartbeat import HEARTBEAT_SECONDS, Heartbeat
from rein.worker.job_table import JobTable
from rein.worker.leases import LeaseKeeper
from rein.worker.metrics import WorkerMetrics, compose_hooks
from rein.worker.publisher import INTERRUPTED, TokenPublisher
from rein.worker.recorder import GroupRecorder
from rein.worker.suspects import EngineRoster, SuspectGate

if TYPE_CHECKING:
    from rein.engine.client import EngineClient
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What the bootstep builds: the model served and its engine configuration.

    `engine_factory` (tests) replaces building an LLMEngine from `engine_config`.
    """

    settings: Any
    model_name: str
    engine_config: EngineConfig | None = None
    engine_factory: Callable[[], LLMEngine] | None = None


@dataclass
class WorkerContext:
    """Everything a task needs while the worker runs; owns and wires the worker's parts
    (see the module docstring), started by `start()`, stopped by `stop()`."""

    app: Celery
    settings: Any
    model_name: str
    worker_name: str
    keys: RedisKeys
    redis: Redis
    sessions: sessionmaker[Session]
    runner: EngineClient
    publisher: TokenPublisher
    metrics: WorkerMetrics | None = None
    listener: CancelListener | None = None
    adapters: AdapterListener | None = None   # announcements of LoRA adapters (with REIN_ENABLE_LORA)
    stopping: threading.Event = field(default_factory=threading.Event)
    reaper: Reaper | None = None
    recorder: GroupRecorder | None = None   # None: each task records its job alone (record_job)
    claimer: GroupClaimer | None = None     # None: each task claims its job alone (claim_job)
    keeper: EngineKeeper | None = None      # replaces a dead engine (rein.worker.engine_keeper)
    engine_ready: threading.Event = field(default_factory=threading.Event)   # clear while the engine is down
    # Suspects of engine deaths (rein.worker.suspects): who shares the engine, who was in it when it died.
    gate: SuspectGate = field(default_factory=SuspectGate)
    roster: EngineRoster = field(default_factory=EngineRoster)
    # Where jobs' images are kept (REIN_FILES_URL, shared with the API; rein.jobs.image_sources):
    # opened at the first job with images (`file_store`).
    filestore: FileStore | None = None
    jobs: JobTable = field(init=False)                 # the jobs the task threads run now
    heartbeat: Heartbeat = field(init=False)
    lease_keeper: LeaseKeeper = field(init=False)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.jobs = JobTable(self.stopping)
        # The engine is read at each beat: the keeper may have replaced the runner since.
        self.heartbeat = Heartbeat(self.redis, self.keys, self.worker_name, self.model_name,
                                   lambda: self.runner.engine, self.engine_ready, self.stopping)
        self.lease_keeper = LeaseKeeper(self.sessions, self.worker_name, self.model_name, self.jobs,
                                        lambda lease: self.interrupt(lease.job_id), self.stopping,
                                        renew_seconds=self.settings.lease_renew_seconds,
                                        lease_seconds=self.settings.lease_seconds)

    def file_store(self) -> FileStore:
        """The file store the API keeps jobs' images in (made at the first call)."""
        if self.filestore is None:
            self.filestore = filestore_for(self.settings)
        return self.filestore

    @property
    def engine(self) -> LLMEngine:
        return self.runner.engine

    def interrupt(self, job_id: str) -> None:
        """Abort the job in the engine so that its task hands it back (not a cancel)."""
        self.jobs.mark_interrupted(job_id)
        self.publisher.mark_abort(job_id, INTERRUPTED)
        self.runner.abort(job_id)

    def interrupt_thread(self, ident: int) -> None:
        lease = self.jobs.lease_of_thread(ident)
        if lease is not None:
            with log_context(job_id=lease.job_id, model=self.model_name, worker=self.worker_name):
                log.warning("interrupting job %s: Celery terminated its task", lease.job_id)
            self.interrupt(lease.job_id)

    def wait_for_engine(self, timeout: float) -> bool:
        """Wait until the engine is up (True) or `timeout` passes (False). An engine seen dead
        here is marked down at once, before the keeper's next look."""
        if not self.runner.alive:
            self.engine_ready.clear()
        return self.engine_ready.wait(timeout)

    def abort(self, job_id: str) -> None:
        """Abort in whichever engine runs now (the keeper may have replaced it)."""
        self.runner.abort(job_id)

    def start(self) -> None:
        self.engine_ready.set()
        self.listener = CancelListener(self.redis, self.keys, self.abort, self.jobs.running_jobs).start()
        if self.settings.enable_lora:
            self.adapters = AdapterListener(self.redis, self.keys, self.model_name, lambda: self.runner).start()
        self.heartbeat.start()
        self.lease_keeper.start()
        if self.reaper is not None:
            self.reaper.start()
        if self.keeper is not None:
            self.keeper.start()

    def stop(self) -> None:
        """Abort what runs (its tasks hand their jobs back) and end every thread.

        Safe to call from several threads: a second caller waits until the first is done.
        """
        with self._stop_lock:
            if not self.stopping.is_set():
                self._stop()

    def _stop(self) -> None:
        log.info("stopping the engine of %s (running jobs go back to the queue)", self.model_name)
        self.stopping.set()
        self.publisher.close()
        if self.listener is not None:
            self.listener.stop()
        if self.adapters is not None:
            self.adapters.stop()
        self.engine_ready.set()   # tasks waiting for a new engine go on, see `stopping`, and requeue
        if self.keeper is not None:
            self.keeper.join(HEARTBEAT_SECONDS)
        self.runner.stop()
        self.publisher.stop()   # after the engine's last events
        if self.metrics is not None:
            self.metrics.stop()
        if self.reaper is not None:
            self.reaper.stop()
        self.heartbeat.join(HEARTBEAT_SECONDS)
        self.lease_keeper.join(HEARTBEAT_SECONDS)
        self.heartbeat.stopped()


def build_context(app: Celery, spec: WorkerSpec, worker_name: str) -> WorkerContext:
    """Load the engine and start its runner, the publisher, the listener and the heartbeat."""
    from rein.engine.client import EngineClient  # imports torch: not at a worker module's import

    settings = spec.settings
    metrics = WorkerMetrics(spec.model_name)
    if settings.worker_metrics_port:
        # Before loading the engine: a port already taken fails the start in seconds, not minutes.
        try:
            metrics.serve(settings.worker_metrics_port)
        except OSError as exc:
            raise RuntimeError(f"cannot serve worker metrics on port {settings.worker_metrics_port}: {exc}; "
                               f"choose a free port with REIN_WORKER_METRICS_PORT or --metrics-port "
                               f"(0 serves none)") from exc
    keys = RedisKeys.from_settings(settings)
    redis = redis_client(settings.redis_url, health_check_interval=30)
    publisher = TokenPublisher(redis, keys, settings.stream_maxlen, settings.stream_ttl_seconds,
                               settings.job_timeout_seconds, background=True)
    roster = EngineRoster()   # its step hook takes finished jobs out of the engine's roster
    on_step = compose_hooks(publisher.publish_step, metrics.observe_step, roster.step)
    name = f"rein-engine-{spec.model_name}"
    engine_cpus = settings.worker_engine_cpus if spec.engine_factory is None else None
    if engine_cpus is not None:
        check_engine_cpus(engine_cpus)

    def make_runner() -> EngineClient:
        runner: EngineClient
        if spec.engine_factory is not None:
            runner = EngineClient(spec.engine_factory(), name=name, on_step=on_step)
        elif settings.worker_engine_process:
            from rein.engine.process_client import ProcessEngineClient  # torch, as above

            # The child logs as this process does when rein set logging up here.
            log_format = None if configured_elsewhere() else settings.log_format
            runner = ProcessEngineClient(spec.engine_config, name=name, on_step=on_step,
                                         log_level=logging.getLogger().level, log_format=log_format,
                                         cpus=engine_cpus)
        else:
            from rein.engine.engine import LLMEngine  # torch, as above

            runner = EngineClient(LLMEngine(spec.engine_config), name=name, on_step=on_step)
        return runner.start()

    runner = make_runner()
    if engine_cpus is not None:
        # After the engine process started (it pins itself); the threads started from here on
        # take this mask from the ones that start them.
        worker_cpus = keep_worker_off(engine_cpus)
        log.info("engine process on CPU(s) %s, the worker's threads on %s", format_cpus(engine_cpus),
                 format_cpus(worker_cpus) or "the same")
    engine = runner.engine
    metrics.attach(engine)
    # One connection per task thread at most; the claim and the record are short transactions.
    threads = engine.config.max_num_seqs + queued_slots(settings) + interactive_slots(settings)
    db = make_engine(settings.database_url, pool_size=min(threads, 16), max_overflow=max(threads - 16, 0) + 4)
    sessions = sessionmaker(db, expire_on_commit=False)
    context = WorkerContext(app=app, settings=settings, model_name=spec.model_name, worker_name=worker_name,
                            keys=keys, redis=redis, sessions=sessions, runner=runner, publisher=publisher,
                            metrics=metrics, reaper=Reaper(settings, sessions, redis, app), roster=roster,
                            recorder=GroupRecorder(sessions, on_batch_lines=partial(
                                announce_batch_progress, redis, keys)),
                            claimer=GroupClaimer(sessions, worker_name, settings.lease_seconds))
    context.keeper = EngineKeeper(context, make_runner)
    context.start()
    log.info("engine ready for %s on %s: %d KV blocks of %d tokens, max %d sequences, %d job slots "
             "(%d kept for interactive jobs)", spec.model_name, engine.config.device, engine.pool.num_blocks,
             engine.pool.block_size, engine.config.max_num_seqs, threads, interactive_slots(settings))
    return context


def worker_context(app: Celery) -> WorkerContext:
    """The running worker's context; RuntimeError when this process runs no engine."""
    context: WorkerContext | None = getattr(app, "rein_context", None)
    if context is None:
        raise RuntimeError("this Celery worker has no rein engine: start it with `rein worker --model NAME`")
    return context
