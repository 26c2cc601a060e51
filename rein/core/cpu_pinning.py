"""CPU pinning: the worker's engine process on cores of its own, the worker's threads off them.

Why: on a host whose cores the engine shares with the worker's own threads (Celery's consumer,
the task threads, the publisher), the API, Postgres and Redis, the scheduler preempts the
engine's step loop for them, and the whole service waits on that loop. On a 2-core machine the
tiny model's batch through the service ran at 0.68x of the engine alone unpinned and 0.77x
pinned, median of 14 rounds each (docs/benchmarks.md, "Batches through the service"). With
`REIN_WORKER_ENGINE_CPUS` the engine process (started on those cores by
rein.engine.process_client, with any tensor-parallel ranks it starts, which split them) keeps
to the cores named, and the worker process's threads keep to the others. Like vLLM's
`VLLM_CPU_OMP_THREADS_BIND`, it is off unless asked for: on a host shared with other services
the operator knows which cores are free.

Linux only: `os.sched_setaffinity` with a thread id sets one thread, so "this process" means
every thread listed in /proc/self/task; threads started later take their creator's mask.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

log = logging.getLogger(__name__)

CPU_LIST_FORMAT = "a Linux CPU list such as 3, 2-3 or 0,4-7"


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0,2-3' -> {0, 2, 3}; ValueError naming the bad part and the format."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"{part!r} in {text!r} is not a CPU number or range (expected "
                             f"{CPU_LIST_FORMAT})") from None
        if low < 0 or high < low:
            raise ValueError(f"{part!r} in {text!r} is not a CPU number or an increasing range (expected "
                             f"{CPU_LIST_FORMAT})")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def available_cpus() -> frozenset[int]:
    """The cores this process may run on."""
    return frozenset(os.sched_getaffinity(0))


def check_engine_cpus(cpus: frozenset[int]) -> None:
    """RuntimeError unless every core in `cpus` is one this process may run on."""
    available = available_cpus()
    missing = cpus - available
    if missing:
        raise RuntimeError(f"REIN_WORKER_ENGINE_CPUS names CPU(s) {format_cpus(missing)}, which this worker "
                           f"cannot run on (it may use {format_cpus(available)}): name cores from that list")


def pin_this_process(cpus: Iterable[int]) -> None:
    """Every thread of this process, and the threads they start, on `cpus` only."""
    cpus = set(cpus)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cpus)
        except (ProcessLookupError, PermissionError):   # a thread that ended meanwhile
            continue


def keep_worker_off(engine_cpus: frozenset[int]) -> frozenset[int]:
    """Move this (the worker's) process's threads to the cores its engine does not use; returns
    them. When the engine has every core, the worker's threads stay where they are (empty set)."""
    rest = available_cpus() - engine_cpus
    if not rest:
        log.warning("REIN_WORKER_ENGINE_CPUS names every core this worker may use (%s): the worker's own "
                    "threads share them with the engine", format_cpus(engine_cpus))
        return frozenset()
    pin_this_process(rest)
    return rest


def format_cpus(cpus: Iterable[int]) -> str:
    """{0, 2, 3} -> '0,2-3'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and runs[-1][1] == cpu - 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)
