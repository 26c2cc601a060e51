"""End to end, the operator's view: `rein top --once` against the running service shows its
worker and its model's queue, and the API's and the worker's log files (stderr not a
terminal, so JSON lines) follow a job by its id without the key's secret or the prompt."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest
from e2e_support import MODEL, REIN, REPO, Service, run_service, submit

pytestmark = pytest.mark.slow

PROMPT = "wombat trombone kaleidoscope"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    with run_service(tmp_path_factory.mktemp("e2e-top"), tiny_models("llama")) as svc:
        yield svc


def json_lines(service: Service, name: str) -> tuple[str, list[dict]]:
    """A process's log file, and its lines that are JSON objects (Celery also prints a banner)."""
    text = (service.logs / name).read_text(errors="replace")
    return text, [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_top_once_shows_the_live_worker_and_the_queue(service: Service) -> None:
    done = subprocess.run([*REIN, "top", "--once"], env=service.env, cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.strip()}
    assert rows["MODEL"][:4] == ["MODEL", "QUEUED", "INTERACTIVE", "BATCH"]
    assert rows[MODEL][4] == "1/1", done.stdout                  # WORKERS: up / known
    worker = rows[service.hostname]
    assert worker[1:3] == [MODEL, "UP"], done.stdout
    assert worker[3].endswith("/16")                             # RUN of REIN_MAX_NUM_SEQS

    as_json = subprocess.run([*REIN, "top", "--once", "--json"], env=service.env, cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    snapshot = json.loads(as_json.stdout)
    [model] = [m for m in snapshot["models"] if m["name"] == MODEL]
    assert model["queued"] == model["interactive"] + model["batch"]
    assert [w["state"] for w in snapshot["workers"] if w["name"] == service.hostname] == ["UP"]


def test_a_jobs_log_lines_carry_its_ids_and_no_secret_or_prompt(service: Service) -> None:
    key = service.keys["a"]
    key_id, secret = key.split("_")[1], key.split("_")[2]
    with service.client("a") as client:
        job_id = submit(client, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0})
        assert service.wait_job(client, job_id)["status"] == "succeeded"

    api_text, api_lines = json_lines(service, "api.log")
    worker_text, worker_lines = json_lines(service, "worker.log")
    # Everything the API logs is JSON, uvicorn's lines included; Celery logs through rein too.
    assert len(api_lines) == len(api_text.splitlines()), api_text
    assert any(line["logger"].startswith("uvicorn") for line in api_lines)
    assert any(line["logger"].startswith("celery") for line in worker_lines)

    [accepted] = [line for line in api_lines if line.get("job_id") == job_id]
    assert accepted["msg"].startswith(f"job {job_id} accepted")
    assert (accepted["key_id"], accepted["model"]) == (key_id, MODEL)
    in_worker = [line for line in worker_lines if line.get("job_id") == job_id]
    assert [line["msg"].split(":")[0] for line in in_worker] == [f"job {job_id} started",
                                                                 f"job {job_id} attempt 1 ended"]
    for line in in_worker:
        assert (line["key_id"], line["model"], line["worker"]) == (key_id, MODEL, service.hostname)

    for text in (api_text, worker_text):
        assert secret not in text
        assert not any(word in text for word in PROMPT.split())
