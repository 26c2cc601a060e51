"""compose.yaml's CPU default, for real: built, started, asked, restarted mid-batch, then
with compose.s3.yaml's object storage, torn down.

Run by tests/deploy/run.sh (`make test-deploy`), which makes the local base images and the
wheelhouse and passes, in the environment, REIN_COMPOSE (`docker compose` or
`docker-compose`), BASE_IMAGE, POSTGRES_IMAGE, REDIS_IMAGE, S3_IMAGE (deploy/images/s3, moto's
S3 server) and PIP_NO_INDEX=1: the image is built with no index and no registry. The stack runs as its own compose project
(REIN_DEPLOY_PROJECT, default rein-deploy-test) with its own image tag and the API on
127.0.0.1 at a free port, so it collides with nothing on the host (whose own Postgres and
Redis hold 5432 and 6379), and random Postgres and Redis passwords. Leftovers of an
interrupted run are removed first; `down -v` runs at the end whatever happened, after the services' logs are written to
REIN_DEPLOY_LOGS (a file; run.sh names one in its cache folder) and, when a test failed,
their last lines printed.

What it checks: the default model is SmolLM2-135M-Instruct (it knows the capital of France,
streamed and not), a key made with the documented one-liner works, and a 20-line batch
through Files and Batches completes every line although the worker is restarted mid-batch.
And the hardening, as Docker applied it: every container without capabilities (but the few
Postgres and Redis may add back), with no-new-privileges and a memory limit; Redis refuses a
client without the password; the containers' memory in use after the batch is printed.
Last, compose.s3.yaml is added to the running stack (only the API is recreated, and the s3
server and its one-shot bucket maker start): a file uploaded and a short batch's output land in
the s3 service's bucket, listed there with boto3, and not in the API's local volume.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = shlex.split(os.environ.get("REIN_COMPOSE", "docker compose"))
PROJECT = os.environ.get("REIN_DEPLOY_PROJECT", "rein-deploy-test")
MODEL = "smollm2"
QUESTION = "What is the capital of France?"
HEALTHY_TIMEOUT = 600.0
BATCH_TIMEOUT = 600.0
BATCH_LINES = 20


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} deploy: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    env: dict[str, str]
    port: int
    key: str = ""
    # The compose files every command names: compose.s3.yaml is added by the S3 test, so that
    # the logs and `down -v` at the end cover its services too.
    files: list[Path] = field(default_factory=lambda: [ROOT / "compose.yaml"])

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        command = [*COMPOSE, "-p", PROJECT, *(a for f in self.files for a in ("-f", str(f))), *args]
        result = subprocess.run(command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{shlex.join(command)} exited {result.returncode}:\n"
                                 f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def state(self, service: str) -> dict:
        container = self.container(service)
        if not container:
            return {}
        out = subprocess.run(["docker", "inspect", "-f", "{{json .State}}", container],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key,
                             max_retries=0, timeout=300)


def wait_healthy(stack: Stack, services: tuple[str, ...], timeout: float) -> None:
    """Every service's health check says healthy; a container that exits fails at once."""
    deadline = time.monotonic() + timeout
    pending = set(services)
    while pending:
        for service in sorted(pending):
            state = stack.state(service)
            if state.get("Status") in ("exited", "restarting") or state.get("Restarting"):
                logs = stack.compose("logs", "--no-color", "--tail", "40", service, check=False).stdout
                raise AssertionError(f"{service} {state.get('Status')} (exit code {state.get('ExitCode')}):\n"
                                     f"{logs[-6000:]}")
            if state.get("Health", {}).get("Status") == "healthy":
                pending.discard(service)
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"not healthy after {timeout:.0f} s: {sorted(pending)}")
        time.sleep(2)


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest):
    env = {**os.environ, "COMPOSE_PROJECT_NAME": PROJECT, "APP_IMAGE": f"{PROJECT}:latest",
           "API_BIND": "127.0.0.1", "POSTGRES_PASSWORD": secrets.token_hex(16),
           "REDIS_PASSWORD": secrets.token_hex(16)}
    for name in ("REIN_MODELS", "WORKER_MODEL", "REIN_KV_CACHE_MEMORY", "REIN_MAX_NUM_SEQS"):
        env.pop(name, None)   # the compose defaults are what is tested
    stack = Stack(env=env, port=free_port())
    env["API_PORT"] = str(stack.port)
    stack.compose("down", "-v", "--remove-orphans", check=False)   # an interrupted run's leftovers

    started = time.monotonic()
    stack.compose("build", "worker", timeout=1800)   # one image, rein's every service runs it
    say(f"image built in {time.monotonic() - started:.1f} s (PIP_NO_INDEX={env.get('PIP_NO_INDEX', '0')}, "
        f"base {env.get('BASE_IMAGE', 'python:3.11-slim')})")
    try:
        started = time.monotonic()
        stack.compose("up", "-d", "--no-build")
        wait_healthy(stack, ("postgres", "redis", "api", "worker"), HEALTHY_TIMEOUT)
        migrate = stack.state("migrate")
        assert migrate.get("Status") == "exited" and migrate.get("ExitCode") == 0, migrate
        say(f"up and healthy in {time.monotonic() - started:.1f} s (API on 127.0.0.1:{stack.port})")

        # The documented one-liner (docs/deployment.md).
        created = stack.compose("exec", "-T", "api", "rein", "keys", "create", "--name", "deploy-test",
                                "--scopes", "inference,batch,usage")
        stack.key = created.stdout.strip().splitlines()[-1]
        assert stack.key and " " not in stack.key, created.stdout
        yield stack
    finally:
        logs = stack.compose("logs", "--no-color", "--timestamps", check=False).stdout
        if os.environ.get("REIN_DEPLOY_LOGS"):   # every service's whole log, for a later look
            Path(os.environ["REIN_DEPLOY_LOGS"]).write_text(logs)
        if request.session.testsfailed:
            print("\n".join(line[:400] for line in logs.splitlines()[-150:]))
        started = time.monotonic()
        stack.compose("down", "-v", "--remove-orphans", check=False)
        say(f"down -v in {time.monotonic() - started:.1f} s")


def test_the_default_model_is_smollm2_and_answers(stack: Stack) -> None:
    with stack.client() as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        started = time.monotonic()
        answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=32, temperature=0)
    text = answer.choices[0].message.content
    say(f"chat completion in {time.monotonic() - started:.2f} s: {text!r} ({answer.usage.completion_tokens} tokens)")
    assert "Paris" in text


def test_a_streamed_answer(stack: Stack) -> None:
    with stack.client() as client:
        started = time.monotonic()
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0,
            stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    say(f"streamed answer in {time.monotonic() - started:.2f} s, {len(chunks)} chunks: {text!r}")
    assert len(chunks) > 2 and "Paris" in text


def test_a_worker_told_to_use_cuda_without_one_exits_at_once(stack: Stack) -> None:
    """This image's torch has no CUDA: the worker refuses at start-up (exit 2) naming the fix,
    which compose.gpu.yaml's bounded `on-failure:3` then cannot turn into a loop."""
    started = time.monotonic()
    result = stack.compose("run", "--rm", "--no-deps", "-T", "-e", "REIN_DEVICE=cuda", "worker", check=False,
                           timeout=120)
    elapsed = time.monotonic() - started
    error = next((line for line in (result.stderr + result.stdout).splitlines() if "error: device" in line), "")
    say(f"worker with REIN_DEVICE=cuda exited {result.returncode} after {elapsed:.1f} s: {error[:120]}...")
    assert result.returncode == 2 and "built without CUDA" in error and "compose.gpu.yaml" in error
    assert elapsed < 60


COUNTRIES = ["France", "Japan", "Italy", "Spain", "Germany", "Egypt", "Canada", "Brazil", "India", "Kenya",
             "Norway", "Peru", "Greece", "Mexico", "Chile", "Poland", "Turkey", "Sweden", "Portugal", "Ireland"]


def test_a_batch_survives_a_worker_restart(stack: Stack) -> None:
    """20 lines; once some are done and some are not, `compose restart worker` (a warm
    shutdown hands running jobs back to the queue); every line must still succeed, once."""
    lines = [{"custom_id": f"line-{i:02d}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "temperature": 0, "max_tokens": 64,
                       "messages": [{"role": "user", "content": f"Tell me about the history of {country}."}]}}
             for i, country in enumerate(COUNTRIES[:BATCH_LINES])]
    content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    with stack.client() as client:
        started = time.monotonic()
        batch = client.batches.create(
            input_file_id=client.files.create(file=("deploy.jsonl", content), purpose="batch").id,
            endpoint="/v1/chat/completions", completion_window="24h")
        restarted_at = None
        while True:
            batch = client.batches.retrieve(batch.id)
            done = batch.request_counts.completed + batch.request_counts.failed if batch.request_counts else 0
            if restarted_at is None and done >= 2:
                # Mid-batch, or the test proves nothing.
                assert done < BATCH_LINES, f"the batch finished before the restart: {batch.request_counts}"
                restart = time.monotonic()
                stack.compose("restart", "worker")
                restarted_at = done
                say(f"worker restarted with {done}/{BATCH_LINES} lines done "
                    f"({time.monotonic() - restart:.1f} s)")
            if batch.status in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.monotonic() - started < BATCH_TIMEOUT, f"batch still {batch.status}: {batch.request_counts}"
            time.sleep(1)
        say(f"batch {batch.status} in {time.monotonic() - started:.1f} s: {batch.request_counts}")
        assert restarted_at is not None
        assert batch.status == "completed", batch
        assert batch.request_counts.model_dump() == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
        assert batch.error_file_id is None
        output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == [line["custom_id"] for line in lines]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in output)
    france = next(o for o in output if o["custom_id"] == "line-00")
    say(f"line-00 answer: {france['response']['body']['choices'][0]['message']['content'][:160]!r}")
    wait_healthy(stack, ("worker",), HEALTHY_TIMEOUT)   # and the restarted worker is healthy again


def test_the_containers_run_hardened(stack: Stack) -> None:
    """What compose.yaml asks for, as Docker applied it (tests/unit/test_compose.py checks the file)."""
    for service in ("postgres", "redis", "api", "worker"):
        out = subprocess.run(["docker", "inspect", "-f", "{{json .HostConfig}}", stack.container(service)],
                             capture_output=True, text=True, check=True).stdout
        host = json.loads(out)
        assert [c.upper() for c in host.get("CapDrop") or []] in (["ALL"], ["CAP_ALL"]), (service, host.get("CapDrop"))
        assert "no-new-privileges:true" in (host.get("SecurityOpt") or []), (service, host.get("SecurityOpt"))
        assert host.get("Memory", 0) > 0, f"{service}: no memory limit"
        assert not host.get("Privileged"), service
    usage = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}",
                            *(stack.container(s) for s in ("postgres", "redis", "api", "worker"))],
                           capture_output=True, text=True, check=False).stdout.strip()
    say("memory now (used / limit): " + "; ".join(usage.splitlines()))


def test_redis_refuses_a_client_without_the_password(stack: Stack) -> None:
    anonymous = stack.compose("exec", "-T", "redis", "sh", "-c", "unset REDISCLI_AUTH; redis-cli ping", check=False)
    assert "NOAUTH" in anonymous.stdout + anonymous.stderr, anonymous
    authenticated = stack.compose("exec", "-T", "redis", "redis-cli", "ping")
    assert "PONG" in authenticated.stdout


# Lists the bucket from inside the s3 container, at moto's own port: what the server holds,
# whatever the API believes it wrote.
LIST_BUCKET = """
import json, sys, boto3
s3 = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", region_name="us-east-1",
                  aws_access_key_id=sys.argv[1], aws_secret_access_key=sys.argv[2])
page = s3.list_objects_v2(Bucket=sys.argv[3])
print(json.dumps({o["Key"]: o["Size"] for o in page.get("Contents", [])}))
"""
S3_LINES = 4


def test_batch_files_in_the_s3_service(stack: Stack) -> None:
    """compose.s3.yaml over the running stack: the API's files go to the s3 service's bucket,
    which the one-shot s3-bucket made before the API (which refuses a missing bucket) started."""
    stack.files.append(ROOT / "compose.s3.yaml")
    stack.env.update(S3_ACCESS_KEY=secrets.token_hex(8), S3_SECRET_KEY=secrets.token_hex(16),
                     S3_BUCKET="rein-deploy-test")
    started = time.monotonic()
    stack.compose("up", "-d", "--no-build")
    wait_healthy(stack, ("api", "worker"), HEALTHY_TIMEOUT)
    made = stack.state("s3-bucket")
    assert made.get("Status") == "exited" and made.get("ExitCode") == 0, made
    say(f"compose.s3.yaml added, api healthy again in {time.monotonic() - started:.1f} s: "
        f"{stack.compose('logs', '--no-color', 's3-bucket').stdout.strip().splitlines()[-1]}")
    for service in ("s3", "s3-bucket"):
        host = json.loads(subprocess.run(["docker", "inspect", "-f", "{{json .HostConfig}}", stack.container(service)],
                                         capture_output=True, text=True, check=True).stdout)
        assert [c.upper() for c in host.get("CapDrop") or []] in (["ALL"], ["CAP_ALL"]), (service, host)
        assert "no-new-privileges:true" in (host.get("SecurityOpt") or []) and host.get("Memory", 0) > 0, service

    lines = [{"custom_id": f"s3-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "temperature": 0, "max_tokens": 16,
                       "messages": [{"role": "user", "content": f"What is the capital of {country}?"}]}}
             for i, country in enumerate(COUNTRIES[:S3_LINES])]
    content = ("\n".join(json.dumps(line) for line in lines) + "\n").encode()
    with stack.client() as client:
        started = time.monotonic()
        uploaded = client.files.create(file=("s3.jsonl", content), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() - started < BATCH_TIMEOUT, f"batch still {batch.status}: {batch.request_counts}"
            time.sleep(1)
            batch = client.batches.retrieve(batch.id)
        say(f"batch on S3 {batch.status} in {time.monotonic() - started:.1f} s: {batch.request_counts}")
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == S3_LINES and batch.request_counts.failed == 0
        output = client.files.content(batch.output_file_id).content
        assert client.files.content(uploaded.id).content == content
    assert sorted(json.loads(line)["custom_id"] for line in output.decode().splitlines()) == \
        [line["custom_id"] for line in lines]

    listed = stack.compose("exec", "-T", "s3", "python3", "-c", LIST_BUCKET, stack.env["S3_ACCESS_KEY"],
                           stack.env["S3_SECRET_KEY"], stack.env["S3_BUCKET"])
    objects = json.loads(listed.stdout.strip().splitlines()[-1])
    say(f"bucket {stack.env['S3_BUCKET']} holds {len(objects)} objects: {objects}")
    assert objects.get(f"files/{uploaded.id}") == len(content), objects
    assert objects.get(f"files/{batch.output_file_id}") == len(output), objects
    # ...and the API's local volume (mounted still, unused) got neither.
    local = stack.compose("exec", "-T", "api", "find", "/data/files", "-name", f"*{uploaded.id}*",
                          "-o", "-name", f"*{batch.output_file_id}*")
    assert local.stdout.strip() == "", local.stdout
