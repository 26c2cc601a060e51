"""`rein run-batch` from and to URLs (rein.offline.locations): s3:// input and output against
moto's HTTP server (tests/conftest.py's s3_server), https/http input from a small local HTTP
server, and the clear refusals (an https output, an unknown scheme, a missing object)."""

from __future__ import annotations

import json
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rein.cli.main import main
from rein.store.s3 import s3_client

ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--max-num-seqs", "2", "--no-progress"]


def batch_input(n: int = 6) -> bytes:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"line {i}", "max_tokens": 3, "temperature": 0}}) for i in range(n)]
    return ("\n".join(lines) + "\n{oops\n").encode()


def answers(data: bytes) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, data.decode().splitlines()) if line["custom_id"]}


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models("llama")


@pytest.fixture
def http_server(tmp_path):
    """A directory served over plain HTTP on a free port; its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_s3_in_s3_out(model_dir, s3_bucket, tmp_path, capsys):
    client = s3_client()
    client.put_object(Bucket=s3_bucket, Key="in/batch.jsonl", Body=batch_input())
    local = tmp_path / "local.jsonl"
    local.write_bytes(batch_input())
    assert main(["run-batch", f"s3://{s3_bucket}/in/batch.jsonl", "-o", f"s3://{s3_bucket}/out/answers.jsonl",
                 "--errors", f"s3://{s3_bucket}/out/errors.jsonl", "--model", str(model_dir), *ENGINE_FLAGS]) == 0
    assert "6 ok, 1 failed" in capsys.readouterr().err
    assert main(["run-batch", str(local), "-o", str(tmp_path / "local-out.jsonl"), "--model", str(model_dir),
                 *ENGINE_FLAGS]) == 0
    remote = answers(client.get_object(Bucket=s3_bucket, Key="out/answers.jsonl")["Body"].read())
    expected = answers((tmp_path / "local-out.jsonl").read_bytes())
    assert set(remote) == {f"r{i}" for i in range(6)}
    for custom_id, line in remote.items():     # greedy: the same text as from the local file
        assert line["response"]["body"]["choices"][0]["text"] == \
            expected[custom_id]["response"]["body"]["choices"][0]["text"]
    (error,) = client.get_object(Bucket=s3_bucket, Key="out/errors.jsonl")["Body"].read().decode().splitlines()
    assert json.loads(error)["error"]["message"].startswith("line 7:")


def test_https_in(model_dir, http_server, s3_bucket, capsys):
    root, base = http_server
    (root / "batch.jsonl").write_bytes(batch_input(3))
    assert main(["run-batch", f"{base}/batch.jsonl", "-o", f"s3://{s3_bucket}/answers.jsonl",
                 "--model", str(model_dir), *ENGINE_FLAGS]) == 0
    assert "3 ok, 1 failed" in capsys.readouterr().err
    body = s3_client().get_object(Bucket=s3_bucket, Key="answers.jsonl")["Body"].read()
    assert set(answers(body)) == {"r0", "r1", "r2"}


def test_refusals(model_dir, http_server, s3_bucket, tmp_path, capsys):
    _, base = http_server
    out = str(tmp_path / "o.jsonl")
    assert main(["run-batch", f"{base}/nope.jsonl", "-o", out, "--model", str(model_dir), *ENGINE_FLAGS]) == 2
    assert "404" in capsys.readouterr().err
    assert main(["run-batch", f"s3://{s3_bucket}/nope.jsonl", "-o", out, "--model", str(model_dir),
                 *ENGINE_FLAGS]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_bytes(batch_input(1))
    assert main(["run-batch", str(tmp_path / "in.jsonl"), "-o", f"{base}/out.jsonl", "--model", str(model_dir)]) == 2
    assert "https:// output is not supported" in capsys.readouterr().err
    assert main(["run-batch", "ftp://host/in.jsonl", "-o", out, "--model", str(model_dir)]) == 2
    assert "want a local path, s3://bucket/key" in capsys.readouterr().err
