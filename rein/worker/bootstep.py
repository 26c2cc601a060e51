"""The worker's long-lived half: the engine and its runner, the token publisher, the
cancel listener, a heartbeat, the lease keeper and a reaper, owned by one Celery bootstep.

The engine steps in a child process of its own (rein.engine.process_client, unless
`Settings.worker_engine_process` is off or a test hands in an engine factory): the runner
here keeps the request streams, and the heartbeat and metrics read its view of the engine.

The lease keeper renews the leases of the jobs this worker runs, all in one statement every
`Settings.lease_renew_seconds` (rein.jobs.claim); a job whose lease it finds lost (the
reaper gave it to another attempt after this worker could not renew in time) is aborted
here, since whatever it computes can no longer be recorded. The reaper
(rein.jobs.reaper) runs in every worker, so a deployment recovers a dead worker's jobs as
long as one worker lives.

The bootstep starts after the pool and before the consumer, so the engine is loaded
before the first message is taken; it stops after the consumer has stopped taking
messages and before the pool waits for its threads. Stopping closes the publisher,
stops the runner (aborting whatever the engine still runs) and so ends every task
promptly: each hands its job back for another worker (rein.jobs.claim.release_job)
instead of keeping the warm shutdown waiting for the longest job. So that this does not
wait for the consumer to close its broker connection first, the same stop also starts as
soon as Celery announces the shutdown (its `worker_shutting_down` signal).

Tasks reach all of this through `worker_context(app)`.

Interactive jobs are never locked out by batch jobs. Celery's consumer takes at most
max_num_seqs + queued_slots messages at once (prefetch 1 per slot, acks late; the queued
slots' jobs wait in the engine for a sequence to end, see rein.jobs.queues), from both of the
model's queues, so batch jobs alone could hold every slot while an interactive job waits on
the queue. `InteractiveConsumer` is a second consumer, on a channel of its own
with its own prefetch limit, that takes only the interactive queue, for up to
`interactive_slots` more jobs, run by as many extra threads of the pool. Those jobs reach
the engine while it is full of batch requests, and the engine's scheduler preempts a batch
request for them (rein.engine.scheduler). Batch jobs never use the interactive slots, so
at most max_num_seqs + queued_slots of them are held (max_num_seqs run); interactive jobs
use every slot.

`EngineThreadPool` is Celery's threads pool plus the one thing it lacks: terminating a
task. Celery terminates tasks on broker connection loss
(`worker_cancel_long_running_tasks_on_connection_loss`), on cold shutdown and on
`revoke(terminate=True)`; a thread cannot be killed, so this pool interrupts the task's
job in the engine instead, and the task hands it back.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery, bootsteps
from celery.concurrency.thread import ApplyResult
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from celery.signals import worker_shutting_down
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from rein.core.logging import log_context
from rein.core.redis_keys import RedisKeys
from rein.jobs.claim import GroupClaimer, Lease, renew_leases
from rein.jobs.reaper import Reaper
from rein.worker.cancel import CancelListener
from rein.worker.engine_keeper import EngineKeeper, SoloLock
from rein.worker.metrics import WorkerMetrics, compose_hooks
from rein.worker.publisher import INTERRUPTED, TokenPublisher
from rein.worker.recorder import GroupRecorder

if TYPE_CHECKING:
    from rein.engine.client import EngineClient
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 5.0
# After a failed lease renewal, try again this often.
LEASE_RETRY_SECONDS = 1.0
# The workers registry (RedisKeys.workers) outlives its last writer by this long.
WORKER_REGISTRY_TTL_SECONDS = 24 * 3600


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
    """Everything a task needs while the worker runs."""

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
    stopping: threading.Event = field(default_factory=threading.Event)
    interrupted: set[str] = field(default_factory=set)
    reaper: Reaper | None = None
    recorder: GroupRecorder | None = None   # None: each task records its job alone (record_job)
    claimer: GroupClaimer | None = None     # None: each task claims its job alone (claim_job)
    keeper: EngineKeeper | None = None      # replaces a dead engine (rein.worker.engine_keeper)
    engine_ready: threading.Event = field(default_factory=threading.Event)   # clear while the engine is down
    solo: SoloLock = field(default_factory=SoloLock)   # a job its engine died under runs alone
    _jobs_by_thread: dict[int, Lease] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)
    _heartbeat: threading.Thread | None = None
    _lease_keeper: threading.Thread | None = None
    started_at: float = field(default_factory=time.time)
    _previous_beat: tuple[float, int, int, float] | None = None   # time and totals at the last beat

    @property
    def engine(self) -> LLMEngine:
        return self.runner.engine

    @contextmanager
    def tracking(self, lease: Lease) -> Iterator[None]:
        """While the calling task thread runs the leased job (for cancels, interrupts and
        lease renewal)."""
        ident = threading.get_ident()
        with self._lock:
            self._jobs_by_thread[ident] = lease
        try:
            yield
        finally:
            with self._lock:
                self._jobs_by_thread.pop(ident, None)
                self.interrupted.discard(lease.job_id)

    def running_jobs(self) -> list[str]:
        with self._lock:
            return [lease.job_id for lease in self._jobs_by_thread.values()]

    def held_leases(self) -> list[Lease]:
        with self._lock:
            return list(self._jobs_by_thread.values())

    def is_interrupted(self, job_id: str) -> bool:
        with self._lock:
            return self.stopping.is_set() or job_id in self.interrupted

    def interrupt(self, job_id: str) -> None:
        """Abort the job in the engine so that its task hands it back (not a cancel)."""
        with self._lock:
            self.interrupted.add(job_id)
        self.publisher.mark_abort(job_id, INTERRUPTED)
        self.runner.abort(job_id)

    def interrupt_thread(self, ident: int) -> None:
        with self._lock:
            lease = self._jobs_by_thread.get(ident)
        job_id = lease.job_id if lease is not None else None
        if job_id is not None:
            with log_context(job_id=job_id, model=self.model_name, worker=self.worker_name):
                log.warning("interrupting job %s: Celery terminated its task", job_id)
            self.interrupt(job_id)

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
        self.listener = CancelListener(self.redis, self.keys, self.abort, self.running_jobs).start()
        self._heartbeat = threading.Thread(target=self._beat, name="rein-heartbeat", daemon=True)
        self._heartbeat.start()
        self._lease_keeper = threading.Thread(target=self._keep_leases, name="rein-lease-keeper", daemon=True)
        self._lease_keeper.start()
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
        self.engine_ready.set()   # tasks waiting for a new engine go on, see `stopping`, and requeue
        if self.keeper is not None:
            self.keeper.join(HEARTBEAT_SECONDS)
        self.runner.stop()
        self.publisher.stop()   # after the engine's last events
        if self.metrics is not None:
            self.metrics.stop()
        if self.reaper is not None:
            self.reaper.stop()
        for thread in (self._heartbeat, self._lease_keeper):
            if thread is not None:
                thread.join(HEARTBEAT_SECONDS)
        try:
            self.redis.delete(self.keys.worker_heartbeat(self.worker_name))
            self._beat_stopped()
        except RedisError:
            pass

    def heartbeat(self) -> dict[str, Any]:
        """What `rein top` shows of this worker (rein.cli.top reads these fields).

        `tokens_per_second` and `step_ms` (mean step duration) cover the time since the
        previous heartbeat; `step_ms` is None when no step ran in it. While the engine is down
        (dead, a new one starting) the state is `down` and there are no engine figures.
        """
        if not self.engine_ready.is_set():
            return {"worker": self.worker_name, "model": self.model_name, "time": time.time(), "state": "down",
                    "started": self.started_at, "interval": HEARTBEAT_SECONDS}
        engine, stats, now = self.engine, self.engine.stats, time.time()
        totals = (now, stats.generation_tokens, stats.steps, stats.step_seconds)
        previous = self._previous_beat or (self.started_at, 0, 0, 0.0)
        self._previous_beat = totals
        elapsed, steps = now - previous[0], stats.steps - previous[2]
        return {"worker": self.worker_name, "model": self.model_name, "time": now, "state": "up",
                "started": self.started_at, "interval": HEARTBEAT_SECONDS,
                "running": engine.num_running, "waiting": engine.num_waiting,
                "max_num_seqs": engine.config.max_num_seqs, "kv_blocks": engine.pool.num_blocks,
                "kv_blocks_free": engine.pool.num_free, "kv_usage": engine.pool.usage,
                "steps": stats.steps, "generation_tokens": stats.generation_tokens,
                "preemptions": stats.preemptions,
                "tokens_per_second": (stats.generation_tokens - previous[1]) / elapsed if elapsed > 0 else 0.0,
                "step_ms": 1000 * (stats.step_seconds - previous[3]) / steps if steps else None}

    def _beat(self) -> None:
        key = self.keys.worker_heartbeat(self.worker_name)
        while not self.stopping.is_set():
            try:
                beat = json.dumps(self.heartbeat())
                # The key expires with the worker; the registry entry stays, so that `rein top`
                # can show a worker that stopped beating as LOST (rein.cli.top forgets it later).
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(key, beat, ex=int(3 * HEARTBEAT_SECONDS))
                pipe.hset(self.keys.workers(), self.worker_name, beat)
                pipe.expire(self.keys.workers(), WORKER_REGISTRY_TTL_SECONDS)
                pipe.execute()
            except (RedisError, RuntimeError) as exc:   # RuntimeError: engine dicts changed under us
                log.debug("heartbeat skipped: %s", exc)
            self.stopping.wait(HEARTBEAT_SECONDS)

    def _keep_leases(self) -> None:
        """Renew the leases of the running jobs every lease_renew_seconds; after a failure
        (Postgres away) try again every LEASE_RETRY_SECONDS, so leases are renewed as soon
        as Postgres is back, before the reaper takes them."""
        interval = self.settings.lease_renew_seconds
        while not self.stopping.wait(interval):
            leases = self.held_leases()
            try:
                held = renew_leases(self.sessions, self.worker_name, leases, self.settings.lease_seconds)
            except SQLAlchemyError as exc:
                log.warning("cannot renew the leases of %d running jobs: %s", len(leases), exc)
                interval = LEASE_RETRY_SECONDS
                continue
            interval = self.settings.lease_renew_seconds
            still_running = {(lease.job_id, lease.attempt) for lease in self.held_leases()}
            for lease in leases:
                key = (lease.job_id, lease.attempt)
                if key not in held and key in still_running:
                    with log_context(job_id=lease.job_id, model=self.model_name, worker=self.worker_name):
                        log.warning("job %s attempt %d: lease lost (not renewed in time); stopping it",
                                    lease.job_id, lease.attempt)
                    self.interrupt(lease.job_id)

    def _beat_stopped(self) -> None:
        """A last registry entry saying this worker stopped on purpose (not LOST)."""
        beat = {"worker": self.worker_name, "model": self.model_name, "time": time.time(),
                "state": "stopped", "started": self.started_at, "interval": HEARTBEAT_SECONDS}
        self.redis.hset(self.keys.workers(), self.worker_name, json.dumps(beat))


def build_context(app: Celery, spec: WorkerSpec, worker_name: str) -> WorkerContext:
    """Load the engine and start its runner, the publisher, the listener and the heartbeat."""
    from rein.core.db import make_engine
    from rein.engine.client import EngineClient

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
    redis = Redis.from_url(settings.redis_url, health_check_interval=30)
    publisher = TokenPublisher(redis, keys, settings.stream_maxlen, settings.stream_ttl_seconds,
                               settings.job_timeout_seconds, background=True)
    on_step = compose_hooks(publisher.publish_step, metrics.observe_step)
    name = f"rein-engine-{spec.model_name}"

    def make_runner() -> EngineClient:
        runner: EngineClient
        if spec.engine_factory is not None:
            runner = EngineClient(spec.engine_factory(), name=name, on_step=on_step)
        elif settings.worker_engine_process:
            from rein.core.logging import configured_elsewhere
            from rein.engine.process_client import ProcessEngineClient

            # The child logs as this process does when rein set logging up here.
            log_format = None if configured_elsewhere() else settings.log_format
            runner = ProcessEngineClient(spec.engine_config, name=name, on_step=on_step,
                                         log_level=logging.getLogger().level, log_format=log_format)
        else:
            from rein.engine.engine import LLMEngine

            runner = EngineClient(LLMEngine(spec.engine_config), name=name, on_step=on_step)
        return runner.start()

    runner = make_runner()
    engine = runner.engine
    metrics.attach(engine)
    # One connection per task thread at most; the claim and the record are short transactions.
    from rein.jobs.queues import interactive_slots, queued_slots

    threads = engine.config.max_num_seqs + queued_slots(settings) + interactive_slots(settings)
    db = make_engine(settings.database_url, pool_size=min(threads, 16), max_overflow=max(threads - 16, 0) + 4)
    sessions = sessionmaker(db, expire_on_commit=False)
    context = WorkerContext(app=app, settings=settings, model_name=spec.model_name, worker_name=worker_name,
                            keys=keys, redis=redis, sessions=sessions, runner=runner, publisher=publisher,
                            metrics=metrics, reaper=Reaper(settings, sessions, redis, app),
                            recorder=GroupRecorder(sessions),
                            claimer=GroupClaimer(sessions, worker_name, settings.lease_seconds))
    context.keeper = EngineKeeper(context, make_runner)
    context.start()
    log.info("engine ready for %s on %s: %d KV blocks of %d tokens, max %d sequences, %d job slots "
             "(%d kept for interactive jobs)", spec.model_name, engine.config.device, engine.pool.num_blocks,
             engine.pool.block_size, engine.config.max_num_seqs, threads, interactive_slots(settings))
    return context


class EngineBootstep(bootsteps.StartStopStep):
    """Owns the WorkerContext for the worker's lifetime."""

    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.context: WorkerContext | None = None

    def start(self, worker: Any) -> None:
        spec: WorkerSpec | None = getattr(worker.app, "rein_worker_spec", None)
        if spec is None:
            raise RuntimeError("no WorkerSpec on the app: call rein.worker.bootstep.configure_worker first")
        self.context = build_context(worker.app, spec, worker.hostname)
        worker.app.rein_context = self.context
        worker_shutting_down.connect(self._on_shutting_down, weak=False)

    def _on_shutting_down(self, sender: Any = None, **_: Any) -> None:
        # Sent from the signal handler as soon as SIGTERM/SIGINT arrives, well before Celery
        # has stopped its consumer and reaches stop(): hand the running jobs back now, from
        # another thread (stopping joins threads, which a signal handler must not wait on).
        context = self.context
        if context is not None and sender == context.worker_name:
            threading.Thread(target=context.stop, name="rein-stop", daemon=True).start()

    def stop(self, worker: Any) -> None:
        worker_shutting_down.disconnect(self._on_shutting_down)
        if self.context is not None:
            self.context.stop()

    def terminate(self, worker: Any) -> None:
        self.stop(worker)

    def shutdown(self, worker: Any) -> None:
        self.stop(worker)


class InteractiveConsumer(bootsteps.ConsumerStep):
    """Takes the model's interactive queue on a channel of its own, whose prefetch limit is
    `interactive_slots`: jobs beyond the main consumer's max_num_seqs, never batch ones (see
    the module docstring). Messages go through Celery's own task handler, as the main
    consumer's do, and are acknowledged on this channel when their task ends (acks late)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)   # the task strategies exist then

    def get_consumers(self, channel: Any) -> list[Any]:
        from kombu import Queue

        from rein.jobs.queues import interactive_slots

        spec: WorkerSpec | None = getattr(self.app, "rein_worker_spec", None)
        slots = interactive_slots(spec.settings) if spec is not None else 0
        if not slots:
            channel.close()
            return []
        name = RedisKeys.from_settings(spec.settings).queue(spec.model_name)
        consumer = self.app.amqp.TaskConsumer(channel, queues=[Queue(name)],
                                              on_message=self._consumer.create_task_handler())
        consumer.qos(prefetch_count=slots)
        return [consumer]

    def start(self, c: Any) -> None:
        self.app = c.app
        self._consumer = c
        super().start(c)

    def stop(self, c: Any) -> None:
        # Only stop taking messages, as Celery's own task consumer does on stop: closing the
        # channel would put the messages of the jobs still running back on the queue (Redis
        # restores a closed channel's unacknowledged messages). `shutdown` closes it, later.
        from kombu.common import ignore_errors

        for consumer in self.consumers or []:
            ignore_errors(c.connection, consumer.cancel)


class EngineThreadPool(ThreadTaskPool):
    """The threads pool, where terminating a task interrupts its job in the engine.

    Its size (Celery's concurrency, which sets the main consumer's prefetch) is max_num_seqs +
    queued_slots;
    it runs `interactive_slots` more threads for the jobs `InteractiveConsumer` takes.
    Each task gets a unique token as its "pid" (Celery keeps it as the request's
    worker_pid and passes it back to terminate_job).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from rein.jobs.queues import interactive_slots

        spec: WorkerSpec | None = getattr(self.app, "rein_worker_spec", None)
        extra = interactive_slots(spec.settings) if spec is not None else 0
        if extra:
            self.executor.shutdown()   # never started a thread
            self.executor = ThreadPoolExecutor(max_workers=self.limit + extra)
        self._tokens = itertools.count(1)
        self._threads: dict[int, int] = {}
        self._threads_lock = threading.Lock()

    def on_apply(self, target: Any, args: Any = None, kwargs: Any = None, callback: Any = None,
                 accept_callback: Any = None, **_: Any) -> ApplyResult:
        from celery.concurrency.base import apply_target

        token = next(self._tokens)

        def run(*a: Any, **kw: Any) -> Any:
            with self._threads_lock:
                self._threads[token] = threading.get_ident()
            try:
                return target(*a, **kw)
            finally:
                with self._threads_lock:
                    self._threads.pop(token, None)

        return ApplyResult(self.executor.submit(apply_target, run, args, kwargs, callback,
                                                accept_callback, pid=token))

    def terminate_job(self, pid: int, signal: Any = None) -> None:
        with self._threads_lock:
            ident = self._threads.get(pid)
        context: WorkerContext | None = getattr(self.app, "rein_context", None)
        if ident is not None and context is not None:
            context.interrupt_thread(ident)


def configure_worker(app: Celery, spec: WorkerSpec) -> None:
    """Make `app` an engine worker for spec.model_name: the bootstep and the pool."""
    app.rein_worker_spec = spec
    app.steps["worker"].add(EngineBootstep)
    app.steps["consumer"].add(InteractiveConsumer)
    app.conf.worker_pool = f"{EngineThreadPool.__module__}:{EngineThreadPool.__qualname__}"


def worker_context(app: Celery) -> WorkerContext:
    """The running worker's context; RuntimeError when this process runs no engine."""
    context: WorkerContext | None = getattr(app, "rein_context", None)
    if context is None:
        raise RuntimeError("this Celery worker has no rein engine: start it with `rein worker --model NAME`")
    return context
