"""End to end: `rein batch submit|status|list|cancel` (a subprocess, as a user runs it) against
`rein api` and `rein worker` subprocesses on a tiny model (see e2e_support).

Through a flaky proxy in front of the API (a real HTTP server in the test), a 503 on each kind
of call and an API that is gone for longer than the client's retries: the command still
succeeds (the official openai client retries; `--wait` keeps polling through the outage).

The CLI finds the API through REIN_API_HOST/REIN_API_PORT (the harness's environment) and
its key through REIN_API_KEY or --api-key; the tests check both, and that each way of
failing (no server, bad key, missing scope, missing file, no key) ends with exit status 2
and a message saying what to change.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
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
    # Enough work that the batch is still running when the cancel lands, a CLI start (seconds
    # on a loaded machine) after validation: 40 such lines once finished first (3 s of engine).
    ids = write_input(tmp_path / "slow.jsonl", 400, max_tokens=300, ignore_eos=True)
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


# -- a flaky API: 503s and an outage -----------------------------------------------------------


class FlakyProxy:
    """A real HTTP server forwarding to the API, that answers 503 (rein's body, Retry-After: 1)
    to the first request matching each of `fail_once` ("METHOD /path-prefix"), and can be
    taken down (connections refused) and brought back on the same port."""

    def __init__(self, upstream: str, fail_once: list[str]) -> None:
        self.upstream = upstream
        self.pending = list(fail_once)
        self.failed: Counter[str] = Counter()
        self.seen: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.port = free_port()
        self.server: ThreadingHTTPServer | None = None
        self.http = httpx.Client(base_url=upstream, timeout=60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FlakyProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def forward(self) -> None:
                path = self.path.split("?")[0]
                call = f"{self.command} {path}"
                with proxy.lock:
                    proxy.seen[call] += 1
                    rule = next((r for r in proxy.pending if call.startswith(r)), None)
                    if rule is not None:
                        proxy.pending.remove(rule)
                        proxy.failed[rule] += 1
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if rule is not None:
                    self.reply(503, {"content-type": "application/json", "retry-after": "1"}, json.dumps(
                        {"error": {"message": "The database of this service is unavailable right now",
                                   "type": "server_error", "param": None, "code": "database_unavailable"}}
                    ).encode())
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
                answer = proxy.http.request(self.command, self.path, headers=headers, content=body)
                self.reply(answer.status_code, {k: v for k, v in answer.headers.items()
                                                if k.lower() in ("content-type", "retry-after")}, answer.content)

            def reply(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = forward

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


def test_submit_wait_succeeds_through_a_503_on_every_call(service: Service, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 6)
    proxy = FlakyProxy(service.base_url, ["POST /v1/files", "POST /v1/batches", "GET /v1/batches/",
                                          "GET /v1/files/"]).start()
    try:
        out = tmp_path / "out.jsonl"
        done = rein_batch(service, "submit", str(tmp_path / "in.jsonl"), "--endpoint", "/v1/completions",
                          "--wait", "--no-progress", "--poll-interval", "0.2", "-o", str(out),
                          "--base-url", proxy.url, key=service.keys["a"])
        assert done.returncode == 0, done.stderr
        # Each kind of call met its 503 once, and was answered on the client's retry.
        assert proxy.failed == Counter({"POST /v1/files": 1, "POST /v1/batches": 1, "GET /v1/batches/": 1,
                                        "GET /v1/files/": 1}), proxy.failed
        assert proxy.seen["POST /v1/files"] == 2 and proxy.seen["POST /v1/batches"] == 2
        assert sorted(line["custom_id"] for line in read_jsonl(out)) == sorted(ids)
        # (one upload and one batch: the retried calls did not make two of either)
        listed = rein_batch(service, "list", "--json", "--limit", "1", "--base-url", proxy.url,
                            key=service.keys["a"])
        assert listed.returncode == 0, listed.stderr
        [newest] = [json.loads(x) for x in listed.stdout.splitlines()]
        assert newest["id"] == done.stdout.strip().splitlines()[-1] and newest["status"] == "completed"
    finally:
        proxy.stop()


def test_wait_survives_an_api_outage_longer_than_the_retries(service: Service, tmp_path: Path) -> None:
    ids = write_input(tmp_path / "in.jsonl", 4)
    proxy = FlakyProxy(service.base_url, []).start()
    out = tmp_path / "out.jsonl"
    env = service.env | {"REIN_API_KEY": service.keys["b"]}
    waiting = subprocess.Popen([*REIN, "batch", "submit", str(tmp_path / "in.jsonl"), "--endpoint",
                                "/v1/completions", "--wait", "--no-progress", "--poll-interval", "0.2", "-o",
                                str(out), "--base-url", proxy.url], env=env, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        batch_id = waiting.stdout.readline().strip()
        assert batch_id.startswith("batch"), batch_id
        proxy.stop()               # the API is gone: connections refused ...
        time.sleep(15)             # ... for longer than the client's own retries (~8 s)
        proxy.start()
        stdout, stderr = waiting.communicate(timeout=CLI_TIMEOUT)
    finally:
        proxy.stop()
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, stderr
    assert "rein is unavailable" in stderr and "asking again" in stderr, stderr
    assert sorted(line["custom_id"] for line in read_jsonl(out)) == sorted(ids)


def test_wait_gives_up_after_max_outage(service: Service, tmp_path: Path) -> None:
    write_input(tmp_path / "in.jsonl", 1)
    proxy = FlakyProxy(service.base_url, []).start()
    env = service.env | {"REIN_API_KEY": service.keys["b"]}
    waiting = subprocess.Popen([*REIN, "batch", "submit", str(tmp_path / "in.jsonl"), "--endpoint",
                                "/v1/completions", "--wait", "--no-progress", "--poll-interval", "0.2",
                                "--max-outage", "2", "--base-url", proxy.url], env=env, cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        batch_id = waiting.stdout.readline().strip()
        proxy.stop()
        stdout, stderr = waiting.communicate(timeout=CLI_TIMEOUT)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 2, stderr
    assert "--max-outage 2" in stderr and f"rein batch status {batch_id}" in stderr, stderr
