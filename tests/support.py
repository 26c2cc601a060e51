"""Helpers shared by the integration and end-to-end tests (pytest fixtures do not flow
between sibling test folders, so plain functions live here)."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest


def unreachable(what: str, exc: Exception) -> None:
    """Skip when a service is missing on a developer's machine; fail in CI, where .ci/run starts it."""
    message = (f"{what} is not reachable ({type(exc).__name__}: {str(exc).strip()}); "
               "start it (see .ci/run) or point the REIN_TEST_* variables at one")
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def connect_postgres(url, dbname: str | None = None):
    """An autocommit psycopg connection to the server of a SQLAlchemy URL (or another database on it)."""
    import psycopg

    from rein.store.db import psycopg_conninfo

    info = psycopg_conninfo(url) | ({"dbname": dbname} if dbname else {})
    return psycopg.connect(autocommit=True, connect_timeout=5, **info)


def delete_prefixed(client, prefix: str) -> None:
    """Delete every Redis key under `prefix` (glob characters in it are escaped)."""
    pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in prefix) + "*"
    batch = []
    for key in client.scan_iter(match=pattern, count=500):
        batch.append(key)
        if len(batch) >= 500:
            client.delete(*batch)
            batch.clear()
    if batch:
        client.delete(*batch)


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll `predicate` until it returns something truthy, or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie has exited all the same)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def queued_job_ids(client, list_key: str) -> list[str]:
    """The job ids of the Celery messages waiting on one of kombu's Redis queue lists."""
    import base64
    import json

    ids = []
    for raw in client.lrange(list_key, 0, -1):
        envelope = json.loads(raw)                       # kombu's envelope, body in base64
        args, _kwargs, _embed = json.loads(base64.b64decode(envelope["body"]))
        ids.append(args[0]["job_id"])
    return ids


# The suite's tiers, one per directory of tests/ (tests/conftest.py marks each test with its own).
TIERS = ("unit", "integration", "e2e", "kernels", "real", "deploy")

# The files whose outcome REIN_CPU_FAST_PATHS can change (rein.kernels.cpu_paths): the CPU
# kernels against torch, and the model tests that compare rein's forward (oneDNN linears,
# native attention and element-wise kernels) with Hugging Face's or a reference. `make
# test-fallback` runs these alone with the fast paths off; the rest of the suite asserts
# scheduling, formats and services, the same on either path.
FAST_PATH_FILES = frozenset({
    "kernels/test_cpu_native.py", "kernels/test_lora_cpu.py", "kernels/test_sliding_window.py",
    "kernels/test_kv_16bit_cpu.py", "kernels/test_rotary_store_cpu.py", "unit/test_kv_cache_dtypes.py",
    "unit/test_decode_max_context.py",
    "unit/test_cpu_fast_paths.py", "unit/test_cpu_native_library.py", "unit/test_engine_dtypes.py",
    "unit/test_engine_parity.py", "unit/test_embeddings_engine.py", "unit/test_lora_engine.py",
    "unit/test_lora_model.py", "unit/test_moe_models.py", "unit/test_packed_gguf_models.py",
    "unit/test_quantized_models.py", "unit/test_sliding_window_models.py", "unit/test_tensor_parallel.py",
    "unit/test_transformers_backend.py", "unit/test_windowed_kv_engine.py",
    "real/test_hf_parity.py",
})
