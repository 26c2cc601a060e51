"""A poison job -- a request that kills its engine whenever it runs -- among 32 jobs: the other 31
succeed, each billed once, and the poison job alone is failed as the cause
(`crashes_its_worker`), found by splitting the suspects (rein.worker.suspects) rather than by
running every job its engine died under alone.

Real Redis and Postgres, a real engine child process. The task is `process_job` called on this
test's threads; `Broker` plays the queue (at most SLOTS deliveries at once, a handed-back job
delivered again), and `PoisonKiller` is the poison: it SIGKILLs the engine process as soon as
the poison job has produced a token in it. The test prints how long the 31 jobs beside the
poison took to finish after the first death (the figures of docs/operations.md)."""

from __future__ import annotations

import os
import secrets
import signal
import statistics
import threading
import time

import pytest
import support

from rein.worker.app import make_worker_celery

WAIT = 300.0
JOBS = 32
# Longer jobs make running suspects one by one cost more (the figures in docs/operations.md).
MAX_TOKENS = int(os.environ.get("REIN_TEST_POISON_MAX_TOKENS", "96"))
MAX_NUM_SEQS = 16
SLOTS = 20          # as a worker's: max_num_seqs + its queued and interactive slots


@pytest.fixture
def worker(make_settings, tiny_models):
    from rein.engine import EngineConfig
    from rein.worker.context import WorkerSpec, build_context

    settings = make_settings(worker_engine_process=True)
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="32MiB", max_model_len=512,
                          max_num_seqs=MAX_NUM_SEQS)
    context = build_context(make_worker_celery(settings), WorkerSpec(settings=settings, model_name="tiny",
                                                                     engine_config=config),
                            f"poisoned-{secrets.token_hex(3)}@test")
    yield context
    context.stop()


class PoisonKiller:
    """Kills the worker's engine process whenever `job_id` has produced a token in it; meanwhile
    notes the most of the jobs present at the first kill (its suspects) that ran side by side
    afterwards (a job runs once it has produced a token)."""

    def __init__(self, context, job_id: str) -> None:
        self.context, self.job_id = context, job_id
        self.kills: list[float] = []
        self.first_suspects: set[str] = set()
        self.peak_suspects_together = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="poison", daemon=True)

    def start(self) -> PoisonKiller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            runner = self.context.runner
            if not runner.alive:
                continue
            streams = dict(runner._streams)
            running = {job_id for job_id, stream in streams.items() if stream.collected.first_token_at is not None}
            self.peak_suspects_together = max(self.peak_suspects_together, len(running & self.first_suspects))
            if self.job_id in running:   # it has run: it kills the engine
                os.kill(runner.pid, signal.SIGKILL)
                if not self.kills:
                    self.first_suspects = set(streams) - {self.job_id}
                self.kills.append(time.monotonic())
                support.wait_for(lambda r=runner: not r.alive, 30, "the engine dead", interval=0.01)


class Broker:
    """Delivers each message to `process_job` on a thread of its own, at most `slots` at once;
    a message whose attempt was handed back ("requeued") is delivered again."""

    def __init__(self, context, slots: int) -> None:
        self.context = context
        self.slots = threading.Semaphore(slots)
        self.outcomes: dict[str, str] = {}
        self.ended_at: dict[str, float] = {}
        self.deliveries = 0
        self._lock = threading.Lock()
        self._pending = 0
        self._done = threading.Event()

    def run(self, messages, timeout: float) -> dict[str, str]:
        self._pending = len(messages)
        for message in messages:
            self._deliver(message)
        assert self._done.wait(timeout), f"{self._pending} jobs not ended after {timeout:.0f} s"
        return self.outcomes

    def _deliver(self, message) -> None:
        threading.Thread(target=self._run, args=(message,), daemon=True).start()

    def _run(self, message) -> None:
        from rein.worker.tasks import process_job

        with self.slots:
            with self._lock:
                self.deliveries += 1
            outcome = process_job(self.context, message)
        if outcome == "requeued":
            self._deliver(message)
            return
        with self._lock:
            self.outcomes[message.job_id] = outcome
            self.ended_at[message.job_id] = time.monotonic()
            self._pending -= 1
            if self._pending == 0:
                self._done.set()


def test_a_poison_job_among_32_is_failed_alone_and_the_others_succeed(worker, make_job, db_sessionmaker):
    from rein.store.tables import Job

    model = f"m{secrets.token_hex(3)}"   # no Celery worker consumes it: the requeued messages stay put
    messages = [make_job(max_tokens=MAX_TOKENS, model=model, prompt=[5, 6, 7 + i]) for i in range(JOBS)]
    poison = messages[JOBS // 2]
    killer = PoisonKiller(worker, poison.job_id).start()
    broker = Broker(worker, SLOTS)
    started = time.monotonic()
    try:
        outcomes = broker.run(messages, WAIT)
    finally:
        killer.stop()
    finished = time.monotonic()

    with db_sessionmaker() as session:
        rows = {job.id: job for job in session.query(Job).filter(Job.id.in_([m.job_id for m in messages]))}
    others = [m.job_id for m in messages if m is not poison]
    assert {outcomes[job_id] for job_id in others} == {"succeeded"}, outcomes
    assert all(rows[job_id].status == "succeeded" for job_id in others)
    # Every engine death was refunded: each of the 31 spent one attempt.
    assert all(rows[job_id].attempt - rows[job_id].attempts_refunded == 1 for job_id in others)
    failed = rows[poison.job_id]
    assert outcomes[poison.job_id] == "failed"
    assert failed.status == "failed" and failed.error["code"] == "crashes_its_worker", failed.error

    first_death = killer.kills[0]
    after = sorted(broker.ended_at[job_id] - first_death for job_id in others)
    print(f"\npoison among {JOBS} jobs of {MAX_TOKENS} tokens (max_num_seqs {MAX_NUM_SEQS}): "
          f"{len(killer.kills)} engine deaths, {broker.deliveries} deliveries, all ended after "
          f"{finished - started:.1f} s; the 31 others after the first death: median "
          f"{statistics.median(after):.1f} s, max {after[-1]:.1f} s; poison failed "
          f"{broker.ended_at[poison.job_id] - first_death:.1f} s after it; at most "
          f"{killer.peak_suspects_together} of its {len(killer.first_suspects)} other suspects ran side by side")
    # The jobs the first death made suspects were not each run alone.
    assert killer.peak_suspects_together >= 2
