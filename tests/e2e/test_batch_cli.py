"""End to end: `rein batch submit|status|cancel` (a subprocess, as a user runs it) against
`rein api` and `rein worker` subprocesses on a tiny model (see e2e_support).

The CLI finds the API through REIN_API_HOST/REIN_API_PORT (the harness's environment) and
its key through REIN_API_KEY or --api-key; the tests check both, and that each way of
failing (no server, bad key, missing scope, missing file, no key) ends with exit status 2
and a message saying what to change.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_support import MODEL, REIN, REPO, Service, run_service
from support import free_port, wait_for

pytestmark = pytest.mark.slow

CLI_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, tiny_models) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("batch-cli")
    with run_service(tmp, tiny_models("llama"), scopes="inference,batch,usage",
                     extra_env={"REIN_FILES_DIR": str(tmp / "files"), "REIN_BATCH_POLL_SECONDS": "0.2"}) as svc:
        yield svc


def rein_batch(service: Service, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = dict(service.env)
    if key is not None:
        env["REIN_API_KEY"] = key
    return subprocess.run([*REIN, "batch", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=CLI_TIMEOUT)


def write_input(path: Path, n: int, **body) -> list[str]:
    ids = [f"cli-{i}" for i in range(n)]
    with path.open("w") as out:
        for i, custom_id in enumerate(ids):
            request = {"model": MODEL, "prompt": f"line {i} of the batch", "max_tokens": 3 + i % 5,
                       "temperature": 0.0, **body}
            out.write(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                                  "body": request}) + "\n")
    return ids


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]




# -- the happy path ---------------------------------------------------------------------------


def test_submit_wait_downloads_every_answer(service: Service, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 12)
    out = tmp_path / "answers.jsonl"
    done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"), "--endpoint", "/v1/completions",
                      "--wait", "--poll-interval", "0.2", "-o", str(out), key=service.keys["a"])
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip().splitlines()[-1]
    assert batch_id.startswith("batch"), done.stdout
    assert "completed" in done.stderr and f"output: {out}" in done.stderr, done.stderr
    lines = read_jsonl(out)
    assert sorted(line["custom_id"] for line in lines) == sorted(ids)   # each exactly once
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["response"]["body"]["object"] == "text_completion"
    assert not (tmp_path / "answers.errors.jsonl").exists()

    status = rein_batch(service, "status", batch_id, "--json", key=service.keys["a"])
    assert status.returncode == 0, status.stderr
    batch = json.loads(status.stdout)
    assert batch["id"] == batch_id and batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    readable = rein_batch(service, "status", batch_id, "--api-key", service.keys["a"])
    assert readable.returncode == 0, readable.stderr
    assert f"{batch_id}  completed" in readable.stdout and "12 completed, 0 failed" in readable.stdout


def test_submit_without_wait_then_cancel(service: Service, tmp_path: Path) -> None:
    write_input(tmp_path / "long.jsonl", 40, max_tokens=400, ignore_eos=True)
    submitted = rein_batch(service, "submit", str(tmp_path / "long.jsonl"), "--endpoint", "/v1/completions",
                           "--metadata", "owner=cli-test", key=service.keys["b"])
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    assert len(submitted.stdout.strip().splitlines()) == 1   # the id alone, for $(...)
    cancelled = rein_batch(service, "cancel", batch_id, "--json", key=service.keys["b"])
    assert cancelled.returncode == 0, cancelled.stderr
    batch = json.loads(cancelled.stdout)
    assert batch["status"] in ("cancelling", "cancelled"), batch
    assert batch["metadata"] == {"owner": "cli-test"}
    # another tenant's batch is not found, and the CLI says so
    other = rein_batch(service, "status", batch_id, key=service.keys["a"])
    assert other.returncode == 2 and "404" in other.stderr, other.stderr


def test_wait_on_a_cancelled_batch_downloads_the_error_file(service: Service, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "slow.jsonl", 40, max_tokens=300, ignore_eos=True)
    out = tmp_path / "slow-out.jsonl"
    env = service.env | {"REIN_API_KEY": service.keys["a"]}
    waiting = subprocess.Popen([*REIN, "batch", "submit", str(tmp_path / "slow.jsonl"), "--endpoint",
                                "/v1/completions", "--wait", "--poll-interval", "0.2", "-o", str(out)],
                               env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        batch_id = waiting.stdout.readline().strip()   # printed before it starts waiting
        assert batch_id.startswith("batch"), batch_id
        # Cancel once validated: then every line exists and is answered (completed or dropped).
        wait_for(lambda: json.loads(rein_batch(service, "status", batch_id, "--json", key=service.keys["a"])
                                    .stdout)["status"] != "validating", 60, "validation")
        cancelled = rein_batch(service, "cancel", batch_id, key=service.keys["a"])
        assert cancelled.returncode == 0, cancelled.stderr
        stdout, stderr = waiting.communicate(timeout=CLI_TIMEOUT)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 1, stderr          # the batch did not complete
    assert "cancelled" in stderr and "errors: " in stderr, stderr
    errors = read_jsonl(tmp_path / "slow-out.errors.jsonl")
    answered = errors + (read_jsonl(out) if out.exists() else [])
    assert sorted(line["custom_id"] for line in answered) == sorted(ids)
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}


def test_wait_on_a_batch_that_fails_validation(service: Service, tmp_path: Path) -> None:
    write_input(tmp_path / "bad.jsonl", 2)
    with (tmp_path / "bad.jsonl").open("a") as fh:
        fh.write("this is not json\n")
    done = rein_batch(service, "submit", str(tmp_path / "bad.jsonl"), "--endpoint", "/v1/completions",
                      "--wait", "--no-progress", key=service.keys["a"])
    assert done.returncode == 1, done.stderr
    assert "  failed  " in done.stderr and "error (line 3)" in done.stderr, done.stderr
    assert not (tmp_path / "bad.output.jsonl").exists()


# -- failures ---------------------------------------------------------------------------------


def test_bad_key(service: Service, tmp_path: Path) -> None:
    write_input(tmp_path / "in.jsonl", 1)
    done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"), key="rein_bad_key")
    assert done.returncode == 2 and done.stdout == ""
    assert "rejected the API key (401" in done.stderr and "--api-key" in done.stderr, done.stderr


def test_missing_batch_scope(service: Service, tmp_path: Path) -> None:
    created = subprocess.run([*REIN, "keys", "create", "--name", "no-batch", "--tenant", "cli-nobatch",
                              "--scopes", "inference"], env=service.env, cwd=REPO, capture_output=True,
                             text=True, timeout=120, check=True)
    write_input(tmp_path / "in.jsonl", 1)
    done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"),
                      key=created.stdout.strip().splitlines()[-1])
    assert done.returncode == 2
    assert "API scope is not declared: batch" in done.stderr and "403" in done.stderr, done.stderr


def test_unreachable_server(service: Service, tmp_path: Path) -> None:
    write_input(tmp_path / "in.jsonl", 1)
    url = f"http://127.0.0.1:{free_port()}"
    done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"), "--base-url", url,
                      key=service.keys["a"])
    assert done.returncode == 2
    assert f"cannot reach rein at {url}" in done.stderr and "--base-url" in done.stderr, done.stderr


def test_missing_file_and_missing_key(service: Service, tmp_path: Path) -> None:
    done = rein_batch(service, "submit", str(tmp_path / "nope.jsonl"), key=service.keys["a"])
    assert done.returncode == 2 and "nope.jsonl does not exist" in done.stderr, done.stderr
    write_input(tmp_path / "in.jsonl", 1)
    done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"))   # no REIN_API_KEY, no flag
    assert done.returncode == 2 and "no API key" in done.stderr and "REIN_API_KEY" in done.stderr


def test_unknown_batch(service: Service) -> None:
    done = rein_batch(service, "status", "batch_doesnotexist", key=service.keys["a"])
    assert done.returncode == 2 and "404" in done.stderr, done.stderr
