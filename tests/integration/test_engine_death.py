"""A worker whose engine process dies (SIGKILL, as the OOM killer would): the jobs it ran go
back with their attempts refunded, as suspects split in halves, the worker says `down` and
takes nothing meanwhile, a new engine starts, and the jobs succeed; a job that dies alone after
an earlier death is failed as the cause (tests/integration/test_poison.py: one among 32). A
tensor-parallel engine is one engine: a rank killed mid-step takes the whole group down, and
it is replaced as one (rein.engine.rank_processes).

Real Redis and Postgres, a real engine child process; the task is `process_job` called on
this test's threads, a message "redelivered" by calling it again."""

from __future__ import annotations

import os
import secrets
import signal
import threading
from dataclasses import replace

import pytest
import support

from rein.model.parallel.shm_reduce import process_alive
from rein.worker.app import make_worker_celery

WAIT = 120.0
MODEL = "tiny"


def job_row(sessions, job_id: str):
    from rein.store.tables import Job

    with sessions() as session:
        return session.get(Job, job_id)


def rank_pids(engine_pid: int) -> list[int]:
    """The other ranks of the tensor-parallel engine in process `engine_pid` (its children running
    the follower module)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, IndexError, ValueError):
            continue
        if parent == engine_pid and b"rein.engine.rank_follower" in command:
            pids.append(int(entry))
    return pids


@pytest.fixture(params=[1, 2], ids=["one-rank", "tensor-parallel-2"])
def process_context(request, make_settings, tiny_models):
    """A worker context (no Celery consumer) whose engine runs in a child process (with one
    more rank, a grandchild, under tensor parallelism)."""
    from rein.engine import EngineConfig
    from rein.worker.context import WorkerSpec, build_context

    settings = make_settings(worker_engine_process=True)
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                          max_num_seqs=4, tensor_parallel_size=request.param)
    context = build_context(make_worker_celery(settings), WorkerSpec(settings=settings, model_name=MODEL,
                                                              engine_config=config), f"dying-{secrets.token_hex(3)}@test")
    yield context
    context.stop()


def run_all(context, messages) -> list[str]:
    from rein.worker.tasks import process_job

    outcomes: list[str | None] = [None] * len(messages)

    def run(i: int) -> None:
        outcomes[i] = process_job(context, messages[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(messages))]
    for thread in threads:
        thread.start()
    return threads, outcomes


def test_a_killed_engine_is_replaced_and_its_jobs_spend_no_attempt(process_context, make_job, db_sessionmaker):
    context = process_context
    # A model no Celery worker of this run consumes: the requeued messages stay for this test.
    model = f"m{secrets.token_hex(3)}"
    messages = [make_job(max_tokens=900, ignore_eos=True, model=model, prompt=[5, 6, 7 + i]) for i in range(3)]
    threads, outcomes = run_all(context, messages)
    support.wait_for(lambda: context.engine.num_running == 3, WAIT, "the three jobs running")
    old_pid = context.runner.pid
    ranks = rank_pids(old_pid)
    assert len(ranks) == context.runner.engine.config.tensor_parallel_size - 1
    # One rank of a tensor-parallel engine, mid-step; else the engine process itself.
    os.kill(ranks[0] if ranks else old_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(WAIT)
    # The whole group is gone: no rank outlives the engine it belonged to.
    support.wait_for(lambda: not any(process_alive(pid) for pid in ranks), WAIT,
                     "the other ranks gone")
    assert outcomes == ["requeued"] * 3
    rows = [job_row(db_sessionmaker, message.job_id) for message in messages]
    for row in rows:
        assert (row.status, row.attempt, row.attempts_refunded, row.deaths_seen) == ("queued", 1, 1, 1)
    # The three present are suspects, in halves: two together, one alone.
    assert sorted(row.suspect_group_size for row in rows) == [1, 2, 2]
    assert len({row.suspect_group for row in rows}) == 2
    # A job that arrives while the engine is down waits for the new one, spending nothing.
    [fresh], fresh_outcome = run_all(context, [make_job(max_tokens=4, model=model)])
    assert context.heartbeat.beat()["state"] == "down" or context.keeper.replacements == 1
    support.wait_for(lambda: context.keeper.replacements == 1 and context.engine_ready.is_set(), WAIT,
                     "a new engine")
    assert context.runner.pid != old_pid
    assert len(rank_pids(context.runner.pid)) == len(ranks)   # the new engine has its ranks
    assert context.heartbeat.beat()["state"] == "up"
    fresh.join(WAIT)
    assert fresh_outcome == ["succeeded"]

    # Redelivered: the suspects run by their halves and succeed.
    threads, outcomes = run_all(context, [replace(m, sampling={**m.sampling, "max_tokens": 8}) for m in messages])
    for thread in threads:
        thread.join(WAIT)
    assert outcomes == ["succeeded"] * 3
    for message in messages:
        row = job_row(db_sessionmaker, message.job_id)
        assert (row.status, row.attempt - row.attempts_refunded) == ("succeeded", 1)


def test_a_job_that_dies_alone_again_is_failed_as_the_cause(process_context, make_job, db_sessionmaker):
    """Alone at its first death, a job is only a suspect of one; dying alone again, it is the cause."""
    from rein.worker.tasks import process_job

    context = process_context
    message = make_job(max_tokens=900)
    for death in (1, 2):
        [thread], outcome = run_all(context, [message])
        support.wait_for(lambda: context.engine.num_running == 1, WAIT, "the job running")
        os.kill(context.runner.pid, signal.SIGKILL)
        thread.join(WAIT)
        support.wait_for(lambda d=death: context.keeper.replacements == d and context.engine_ready.is_set(), WAIT,
                         "a new engine")
        row = job_row(db_sessionmaker, message.job_id)
        if death == 1:
            assert outcome == ["requeued"]
            assert (row.status, row.deaths_seen, row.suspect_group_size, row.attempts_refunded) == ("queued", 1, 1, 1)
    assert outcome == ["failed"]
    assert row.status == "failed" and row.error["code"] == "crashes_its_worker"
    assert "2 times, the last time with this job alone" in row.error["message"]
    # The jobs after it run as before.
    assert process_job(context, make_job(max_tokens=4)) == "succeeded"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_pinned_engine_and_its_replacement_keep_their_cores(make_settings, tiny_models, make_job):
    """REIN_WORKER_ENGINE_CPUS: the engine process on the named core, the worker's threads on
    the others, and a replacement engine pinned like the first."""
    from rein.core.cpu_pinning import pin_this_process
    from rein.engine import EngineConfig
    from rein.worker.context import WorkerSpec, build_context
    from rein.worker.tasks import process_job

    cores = os.sched_getaffinity(0)
    engine_core = max(cores)
    settings = make_settings(worker_engine_process=True, worker_engine_cpus=str(engine_core))
    config = EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="16MiB", max_model_len=1024,
                          max_num_seqs=4)

    def thread_masks(pid: int) -> list[set[int]]:
        return [os.sched_getaffinity(int(task)) for task in os.listdir(f"/proc/{pid}/task")]

    context = build_context(make_worker_celery(settings), WorkerSpec(settings=settings, model_name=MODEL,
                                                                     engine_config=config),
                            f"pinned-{secrets.token_hex(3)}@test")
    try:   # this test process is the worker: its threads are moved off the engine's core
        assert all(mask == cores - {engine_core} for mask in thread_masks(os.getpid()))
        assert process_job(context, make_job(max_tokens=4)) == "succeeded"
        assert all(mask == {engine_core} for mask in thread_masks(context.runner.pid))
        old_pid = context.runner.pid
        os.kill(old_pid, signal.SIGKILL)
        support.wait_for(lambda: context.keeper.replacements == 1 and context.engine_ready.is_set(), WAIT,
                         "a new engine")
        assert process_job(context, make_job(max_tokens=4)) == "succeeded"
        assert context.runner.pid != old_pid
        assert all(mask == {engine_core} for mask in thread_masks(context.runner.pid))
    finally:
        context.stop()
        pin_this_process(cores)   # the rest of the session runs on every core again
