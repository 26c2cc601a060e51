"""The Celery side of the worker's engine: the bootstep that owns the worker context
(rein.worker.context) for the worker's lifetime, the consumer step that keeps slots for
interactive jobs, the threads pool that can terminate a task, and `configure_worker`, which
adds the three to a Celery app.

The bootstep starts after the pool and before the consumer, so the engine is loaded
before the first message is taken; it stops after the consumer has stopped taking
messages and before the pool waits for its threads. Stopping the context ends every task
promptly (each hands its job back); so that this does not wait for the consumer to close its
broker connection first, the same stop also starts as soon as Celery announces the shutdown
(its `worker_shutting_down` signal).

Interactive jobs are never locked out by batch jobs. Celery's consumer takes at most
max_num_seqs + queued_slots messages at once (prefetch 1 per slot, acks late; the queued
slots' jobs wait in the engine for a sequence to end, see rein.jobs.queues), from both of the
model's queues, so batch jobs alone could hold every slot while an interactive job waits on
the queue. `InteractiveConsumer` is a second consumer, on a channel of its own
with its own prefetch limit (each channel counts only the messages it popped:
rein.worker.channel_delivery), that takes only the interactive queue, for up to
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
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery, bootsteps
from celery.concurrency.thread import ApplyResult
from celery.concurrency.thread import TaskPool as ThreadTaskPool
from celery.signals import worker_shutting_down
from kombu import Queue
from kombu.common import ignore_errors

from rein.jobs.queues import interactive_slots
from rein.store.redis_keys import RedisKeys
from rein.worker.context import WorkerContext, WorkerSpec, build_context


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
