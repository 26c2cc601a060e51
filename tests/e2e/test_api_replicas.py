"""Two `rein api` replicas as on two hosts: each its own process, port, working directory and
REIN_FILES_DIR, sharing one Postgres database, one Redis prefix, one worker on the tiny model and
one S3 bucket (REIN_FILES_URL=s3://bucket/prefix on moto's HTTP server, tests/conftest.py).

A load balancer sends a client's calls to any replica, so a file must be everywhere at once:
a batch input uploaded through the first replica is the input of a batch created through the
second, whose output file the first serves, and the input comes back byte for byte through the
second. Nothing is written under either replica's local directories: the files live in the
bucket. Also: a replica whose bucket does not exist refuses to start, with the one line of
rein.store.s3.check_files_url naming the bucket and what to do.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2e_support import MODEL, STARTUP_TIMEOUT, Service, run_service
from support import free_port, wait_for

pytestmark = pytest.mark.slow

PREFIX = "rein/files"
REQUESTS = 4
BATCH_TIMEOUT = 40.0


@dataclass
class Replicas:
    service: Service             # the first replica (run_service's API) and the worker
    second_url: str
    local_dirs: list[Path]       # each replica's working directory and REIN_FILES_DIR
    bucket: str
    s3: object                   # a boto3 client on the bucket's server
    refused: subprocess.Popen    # a third replica, on a bucket that does not exist
    missing_bucket: str

    def client(self, replica: int, tenant: str = "a") -> httpx.Client:
        client = self.service.client(tenant)
        if replica == 2:
            client.base_url = self.second_url
        return client


def _aws_env(endpoint: str) -> dict[str, str]:
    """The standard variables that point boto3 (in the API processes too) at moto's server."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1"}


def _s3_client(endpoint: str):
    import boto3

    return boto3.session.Session().client("s3", **{
        "endpoint_url": endpoint, "aws_access_key_id": "test", "aws_secret_access_key": "test",
        "region_name": "us-east-1"})


def _replica_env(root: Path, name: str) -> tuple[Path, dict[str, str]]:
    """A replica's own working directory, with its REIN_FILES_DIR under it (which an S3 store
    must never use: the test checks that it stays empty)."""
    home = root / name
    home.mkdir()
    return home, {"REIN_FILES_DIR": str(home / "files")}


def _ready(url: str, proc) -> bool:
    if proc.poll() is not None:
        raise AssertionError(f"the second API exited early ({proc.returncode})")
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, tiny_models, s3_server: str) -> Iterator[Replicas]:
    root = tmp_path_factory.mktemp("replicas")
    s3 = _s3_client(s3_server)
    bucket = f"rein-replicas-{secrets.token_hex(4)}"
    s3.create_bucket(Bucket=bucket)
    shared = _aws_env(s3_server) | {"REIN_FILES_URL": f"s3://{bucket}/{PREFIX}", "REIN_BATCH_POLL_SECONDS": "0.2"}
    # The first replica is run_service's own API; it runs in the checkout, so its local files
    # directory is pointed elsewhere, under a directory of its own.
    first_home, first_env = _replica_env(root, "api1")
    with run_service(root, tiny_models("llama"), scopes="inference,batch", extra_env=shared | first_env) as svc:
        second_home, second_env = _replica_env(root, "api2")
        port = free_port()
        second = svc.spawn("api2", "api", cwd=second_home, env_update=second_env | {"REIN_API_PORT": str(port)})
        # Started now, so that its imports overlap the second replica's.
        missing_home, missing_env = _replica_env(root, "api-missing-bucket")
        missing = f"{bucket}-missing"
        refused = svc.spawn("api-missing", "api", cwd=missing_home, env_update=missing_env | {
            "REIN_FILES_URL": f"s3://{missing}/{PREFIX}", "REIN_API_PORT": str(free_port())})
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url, second), STARTUP_TIMEOUT, "the second API's /readyz", interval=0.25)
        yield Replicas(svc, url, [first_home, second_home], bucket, s3, refused, missing)


def _batch_input() -> bytes:
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": MODEL, "prompt": f"Replica story {i}:", "max_tokens": 4,
                                        "temperature": 0.0}}) + "\n"
                   for i in range(REQUESTS)).encode()


def _wait_batch(replicas: Replicas, client: httpx.Client, batch_id: str) -> dict:
    def finished() -> dict | None:
        batch = client.get(f"/v1/batches/{batch_id}").raise_for_status().json()
        return batch if batch["status"] in ("completed", "failed", "expired", "cancelled") else None

    try:
        return wait_for(finished, BATCH_TIMEOUT, f"batch {batch_id} to finish", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}{replicas.service.diagnostics()}") from None


def _files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


def test_a_batch_across_replicas_keeps_its_files_in_the_bucket(replicas: Replicas) -> None:
    content = _batch_input()
    with replicas.client(1) as first, replicas.client(2) as second:
        upload = first.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
        assert upload.status_code == 200, upload.text
        file_id = upload.json()["id"]

        created = second.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                                   "completion_window": "24h"})
        assert created.status_code == 200, created.text
        done = _wait_batch(replicas, first, created.json()["id"])   # the state is shared too
        assert done["status"] == "completed", done
        assert done["request_counts"] == {"total": REQUESTS, "completed": REQUESTS, "failed": 0}

        output = first.get(f"/v1/files/{done['output_file_id']}/content")
        assert output.status_code == 200, output.text
        lines = [json.loads(line) for line in output.text.splitlines()]
        assert sorted(x["custom_id"] for x in lines) == [f"req-{i}" for i in range(REQUESTS)]
        for line in lines:
            assert line["error"] is None and line["response"]["status_code"] == 200, line
            assert line["response"]["body"]["choices"][0]["text"] is not None

        echoed = second.get(f"/v1/files/{file_id}/content")
        assert echoed.status_code == 200 and echoed.content == content

    listed = replicas.s3.list_objects_v2(Bucket=replicas.bucket, Prefix=f"{PREFIX}/")
    keys = {item["Key"] for item in listed.get("Contents", [])}
    assert {f"{PREFIX}/{file_id}", f"{PREFIX}/{done['output_file_id']}"} <= keys
    for home in replicas.local_dirs:     # the replicas' own disks hold no file
        assert _files_under(home) == [], f"files written under {home}"


def test_a_replica_refuses_a_missing_bucket(replicas: Replicas) -> None:
    code = replicas.refused.wait(STARTUP_TIMEOUT)
    log = (replicas.service.logs / "api-missing.log").read_text(errors="replace")
    assert code != 0, log
    assert "Traceback" not in log, log       # refused by `rein api` itself, before uvicorn starts
    # One line says it all: the bucket, the S3 error, what to do.
    assert any(f"bucket '{replicas.missing_bucket}'" in line and "NoSuchBucket" in line
               and "create the bucket" in line for line in log.splitlines()), log
