"""`rein api` with REIN_API_WORKERS=2: two API processes on one port, both serving, both
logging like the single-process API, /metrics on either counting both, and all of them gone
after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from api_support import auth
from support import free_port, pid_alive

STARTUP_TIMEOUT = 120.0






def accepted_jobs(exposition: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(exposition)
               for sample in family.samples
               if sample.name == "rein:api_requests_total" and sample.labels.get("route") == "/v1/jobs"
               and sample.labels.get("status") == "202")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                continue
    return found


@pytest.mark.slow
def test_two_api_processes_serve_one_port(settings_env, tiny_models, monkeypatch, tmp_path, make_key,
                                          tenant):
    monkeypatch.setenv("REIN_MODELS", f"tiny={tiny_models('llama')}@512")
    monkeypatch.setenv("REIN_API_WORKERS", "2")
    monkeypatch.setenv("REIN_LOG_FORMAT", "json")
    port = free_port()
    log_path = tmp_path / "api.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "rein.cli.main", "api", "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
    workers: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        key = make_key(tenant, "inference,usage,admin")
        deadline = time.monotonic() + STARTUP_TIMEOUT
        served_by: set[str] = set()
        # Each process logs its own "rein api ready"; wait until both have.
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"rein api exited early:\n{log_path.read_text()}"
            ready_lines = [line for line in log_path.read_text().splitlines() if "rein api ready" in line]
            if len(ready_lines) >= 2:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(f"two API processes not ready in time:\n{log_path.read_text()}")
        for line in ready_lines:
            assert json.loads(line)["msg"].startswith("rein api ready")   # each process logs JSON
        # uvicorn's workers are spawned processes (multiprocessing.spawn); its resource
        # tracker is another child, not a worker.
        workers = [pid for pid in children(proc.pid)
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 2, f"expected two API worker processes under {proc.pid}: {workers}"
        # A new connection per request (Connection: close), so both processes take some.
        with httpx.Client(base_url=base, timeout=10, headers={"Connection": "close"}) as client:
            for _ in range(20):
                response = client.post("/v1/jobs", headers=auth(key), json={
                    "endpoint": "/v1/completions", "body": {"model": "tiny", "prompt": "hi", "max_tokens": 2}})
                assert response.status_code == 202, response.text
                served_by.add(response.json()["id"])
            # Whichever process answers the scrape reports the requests both processes served.
            for _ in range(4):
                assert accepted_jobs(client.get("/metrics", headers=auth(key)).text) == 20
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, log_path.read_text()
    assert not [pid for pid in workers if pid_alive(pid)], "an API worker process outlived SIGTERM"
    assert len(served_by) == 20
