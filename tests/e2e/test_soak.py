"""A 2-minute soak (bench/soak.py): async jobs, streamed chats and a batch while a seeded fault
strikes every 17 s (worker, engine, API, Redis with and without its AOF, Postgres); every
accepted job and batch line must end `succeeded`, nothing lost or billed twice, no 500."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# bench/ at the end of sys.path, and only while soak is imported: first, its modules (kernels.py,
# models.py, ...) would shadow installed packages of the same name (transformers imports the
# `kernels` package when it is installed, as soak's own imports already do).
BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.append(BENCH)
try:
    from soak import parse_args, passed, soak
finally:
    sys.path.remove(BENCH)

pytestmark = pytest.mark.slow


def test_a_short_soak_ends_every_job_succeeded(tiny_models):
    # A fault every 17 s: seven in two minutes, so each of the six kinds strikes at least once.
    report = soak(parse_args(["--minutes", "2", "--fault-every", "17", "--seed", "1"]), tiny_models("llama"),
                  log=print)
    print(report)
    assert {fault.split()[0] for fault in report["faults"]} == {"worker", "engine", "api", "redis-aof", "redis-empty",
                                                               "postgres"}
    assert passed(report), report
