"""`rein up` as a real process: it migrates, starts the API and a worker, forwards their
output with a prefix, and on SIGINT stops both children and exits 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from support import free_port, pid_alive

STARTUP_TIMEOUT = 120.0  # typically ~40 s: two processes importing torch at once
EXIT_TIMEOUT = 20.0






def child_pids(log: str) -> dict[str, int]:
    return {name: int(pid) for name, pid in re.findall(r"rein up: started (\w+) \(pid (\d+)\)", log)}


@pytest.mark.slow
def test_up_serves_and_stops_both_children_on_sigint(settings_env, tiny_models, monkeypatch, tmp_path):
    monkeypatch.setenv("REIN_MODELS", f"tiny={tiny_models('llama')}@512")
    monkeypatch.setenv("REIN_DEVICE", "cpu")
    monkeypatch.setenv("REIN_KV_CACHE_MEMORY", "16MiB")
    monkeypatch.setenv("REIN_MAX_NUM_SEQS", "2")
    port = free_port()
    log_path = tmp_path / "up.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "rein.cli.main", "up", "--host", "127.0.0.1",
                                 "--port", str(port)],
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        ready = worker_ready = False
        while time.monotonic() < deadline and not (ready and worker_ready):
            assert proc.poll() is None, f"rein up exited early ({proc.returncode}):\n{log_path.read_text()}"
            if not ready:
                try:
                    ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    pass
            # Celery logs "<hostname> ready." once it consumes; its lines carry the worker prefix.
            worker_ready = any(line.startswith("worker ") and "ready." in line
                               for line in log_path.read_text().splitlines())
            time.sleep(0.2)
        log = log_path.read_text()
        assert ready and worker_ready, f"not ready after {STARTUP_TIMEOUT} s (api {ready}, worker {worker_ready}):\n{log}"
        pids = child_pids(log)
        assert set(pids) == {"api", "worker"}, log
        assert all(pid_alive(pid) for pid in pids.values())
        assert any(line.startswith("api    | ") for line in log.splitlines()), log

        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rein up still running {EXIT_TIMEOUT} s after SIGINT:\n{log_path.read_text()}")
        log = log_path.read_text()
        assert rc == 0, log
        assert "rein up: stopped" in log
        assert not any(pid_alive(pid) for pid in pids.values()), log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in child_pids(log_path.read_text()).values():
            if pid_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def test_up_without_models_is_a_clear_error(settings_env):
    result = subprocess.run([sys.executable, "-m", "rein.cli.main", "up"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "REIN_MODELS" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_up_stops_the_other_child_and_fails_when_one_exits(settings_env, monkeypatch, tmp_path):
    # The model directory does not exist: both children refuse to start, and `rein up` with them.
    monkeypatch.setenv("REIN_MODELS", f"gone={tmp_path / 'no-such-model'}")
    monkeypatch.setenv("REIN_DEVICE", "cpu")
    result = subprocess.run([sys.executable, "-m", "rein.cli.main", "up", "--port", str(free_port())],
                            capture_output=True, text=True, timeout=STARTUP_TIMEOUT + EXIT_TIMEOUT)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"rein up: (api|worker) exited with code [1-9]", result.stderr), result.stderr
    pids = child_pids(result.stdout)
    assert set(pids) == {"api", "worker"}
    assert not any(pid_alive(pid) for pid in pids.values())
