"""Upload limits against real Postgres and Redis: a chunked upload (no Content-Length) is cut
off at REIN_MAX_FILE_BYTES as it arrives, and a tenant's uploads are held to its storage
quota (REIN_MAX_TENANT_FILE_BYTES), also when they race.

The TestClient reads a streamed request body whole before handing it to the app, so the
chunked uploads here drive the ASGI app directly, on the TestClient's event loop: the body
arrives chunk by chunk without Content-Length, as from a real server, and the test counts
how much of it the app pulled.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
from api_support import auth
from sqlalchemy import select

from rein.store.tables import ApiKey, File, new_file_id

BOUNDARY = "rein-test-boundary"
TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()
CHUNK = 64 * 1024
MiB = 1 << 20


def purpose_part(purpose: str = "batch") -> bytes:
    return f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'.encode()


def file_head(name: str = "in.jsonl") -> bytes:
    return (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n").encode()


@dataclass
class Pulled:
    bytes: int = 0


async def body_of(pieces: Iterable[bytes], pulled: Pulled | None = None) -> AsyncIterator[bytes]:
    for piece in pieces:
        if pulled is not None:
            pulled.bytes += len(piece)
        yield piece


async def post_streamed(client, key: str, chunks: AsyncIterator[bytes]) -> tuple[int, dict[str, Any]]:
    """POST /v1/files through the ASGI app with the body in the given chunks, no Content-Length."""
    headers = [(b"authorization", f"Bearer {key}".encode()),
               (b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
               (b"transfer-encoding", b"chunked")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/files", "raw_path": b"/v1/files", "root_path": "",
             "query_string": b"", "headers": headers, "client": ("testclient", 50000),
             "server": ("testserver", 80), "state": client.app_state.copy()}
    body_done = False
    response_done = anyio.Event()
    status = 0
    body = bytearray()

    async def receive() -> dict[str, Any]:
        nonlocal body_done
        if not body_done:
            try:
                return {"type": "http.request", "body": await anext(chunks), "more_body": True}
            except StopAsyncIteration:
                body_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
        await response_done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))
            if not message.get("more_body", False):
                response_done.set()

    await client.app(scope, receive, send)
    return status, json.loads(body)


def upload(client, key: str, content: bytes):
    return client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                       files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")})


def test_chunked_upload_over_the_limit_is_cut_off_as_it_arrives(make_client, make_key, tenant, tmp_path):
    files_dir = tmp_path / "files"
    limit = 3 * MiB
    client = make_client(files_dir=str(files_dir), max_file_bytes=limit)
    key = make_key(tenant, "batch")
    pulled = Pulled()
    during: list[list[str]] = []

    def pieces():
        yield purpose_part() + file_head()
        for i in range(1024):                 # 64 MiB offered
            if i == 40:                       # 2.5 MiB in: the bytes are in the store's temp file
                during.append(os.listdir(files_dir))
            yield b"x" * (CHUNK - 1) + b"\n"
        yield TAIL

    status, body = client.portal.call(post_streamed, client, key, body_of(pieces(), pulled))
    assert status == 413, body
    error = body["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file"
    assert f"{limit} bytes" in error["message"] and "REIN_MAX_FILE_BYTES" in error["message"]
    # Refused at the limit, not after reading the body: at most one chunk past it was pulled.
    assert limit < pulled.bytes <= limit + CHUNK + len(purpose_part() + file_head())
    assert len(during) == 1 and len(during[0]) == 1 and during[0][0].startswith(".upload-")
    assert os.listdir(files_dir) == []        # the temporary file is gone, nothing stored
    assert client.get("/v1/files", headers=auth(key)).json()["data"] == []


def test_chunked_upload_within_the_limit_is_stored(make_client, make_key, tenant, tmp_path):
    files_dir = tmp_path / "files"
    client = make_client(files_dir=str(files_dir), max_file_bytes=3 * MiB)
    key = make_key(tenant, "batch")
    content = (b"y" * (CHUNK - 1) + b"\n") * 40
    # The purpose after the file this time: the order of the parts does not matter.
    pieces = [file_head(), *(content[i:i + 10_000] for i in range(0, len(content), 10_000)),
              b"\r\n" + purpose_part().removesuffix(b"\r\n"), TAIL]
    status, file = client.portal.call(post_streamed, client, key, body_of(pieces))
    assert status == 200, file
    assert (file["bytes"], file["filename"], file["purpose"]) == (len(content), "in.jsonl", "batch")
    assert client.get(f"/v1/files/{file['id']}/content", headers=auth(key)).content == content
    assert os.listdir(files_dir) == [file["id"]]


def test_cut_off_or_malformed_bodies_store_nothing(make_client, make_key, tenant, tmp_path):
    files_dir = tmp_path / "files"
    client = make_client(files_dir=str(files_dir))
    key = make_key(tenant, "batch")
    truncated = [purpose_part(), file_head(), b"z" * (2 * MiB)]          # no closing boundary
    status, body = client.portal.call(post_streamed, client, key, body_of(truncated))
    assert status == 400 and "closing boundary" in body["error"]["message"], body
    two_files = [purpose_part(), file_head(), b"a\n", b"\r\n" + file_head(), b"b\n", TAIL]
    status, body = client.portal.call(post_streamed, client, key, body_of(two_files))
    assert status == 400 and body["error"]["param"] == "file", body
    bad_purpose = [purpose_part("fine-tune"), file_head(), b"c\n", TAIL]
    status, body = client.portal.call(post_streamed, client, key, body_of(bad_purpose))
    assert status == 400 and body["error"]["param"] == "purpose", body
    assert not files_dir.exists() or os.listdir(files_dir) == []
    assert client.get("/v1/files", headers=auth(key)).json()["data"] == []


def test_tenant_storage_quota(make_client, make_key, tenant, tmp_path, db_sessionmaker):
    files_dir = tmp_path / "files"
    client = make_client(files_dir=str(files_dir), max_file_bytes=1000, max_tenant_file_bytes=300)
    key, other = make_key(tenant, "batch"), make_key(f"{tenant}-other", "batch")
    with db_sessionmaker.begin() as session:   # a batch's output: counted against the quota too
        key_id = session.scalar(select(ApiKey.key_id).where(ApiKey.tenant == tenant))
        session.add(File(id=new_file_id(), tenant=tenant, key_id=key_id, filename="out.jsonl",
                         purpose="batch_output", bytes=50))

    first = upload(client, key, b"a" * 100)
    assert first.status_code == 200, first.text
    assert upload(client, key, b"b" * 100).status_code == 200
    refused = upload(client, key, b"c" * 100)
    assert refused.status_code == 413, refused.text
    error = refused.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "file"
    for part in ("250 bytes are stored", "200 in uploaded files", "50 in batch output", "quota of 300 bytes",
                 "REIN_MAX_TENANT_FILE_BYTES", "DELETE /v1/files/"):
        assert part in error["message"], error["message"]
    # The same upload chunked, without Content-Length: cut off once it passes the 50 bytes left.
    pulled = Pulled()
    chunks = body_of([purpose_part() + file_head(), *([b"c" * 10] * 1010), TAIL], pulled)
    status, body = client.portal.call(post_streamed, client, key, chunks)
    assert status == 413 and body["error"]["code"] == "storage_quota_exceeded", body
    assert pulled.bytes <= len(purpose_part() + file_head()) + 60

    assert upload(client, other, b"d" * 100).status_code == 200      # another tenant: unaffected
    assert upload(client, key, b"e" * 50).status_code == 200         # exactly fills the quota
    full = upload(client, key, b"f")
    assert full.status_code == 413 and "at most 0 more bytes" in full.json()["error"]["message"]

    # Full: no batch starts either, as its output files would add to the storage.
    batch = client.post("/v1/batches", headers=auth(key), json={
        "input_file_id": first.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
    assert batch.status_code == 413, batch.text
    assert batch.json()["error"]["code"] == "storage_quota_exceeded"
    assert "A new batch (its output and error files count" in batch.json()["error"]["message"]
    assert client.get("/v1/batches", headers=auth(key)).json()["data"] == []

    assert client.delete(f"/v1/files/{first.json()['id']}", headers=auth(key)).status_code == 200
    assert upload(client, key, b"g" * 100).status_code == 200        # deleting freed the room
    assert len(os.listdir(files_dir)) == 4                            # b, e, g and the other's d


def test_racing_uploads_cannot_pass_the_quota(make_client, make_key, tenant, tmp_path):
    files_dir = tmp_path / "files"
    client = make_client(files_dir=str(files_dir), max_file_bytes=1000, max_tenant_file_bytes=250)
    key = make_key(tenant, "batch")

    async def race() -> tuple[tuple[int, dict], tuple[int, dict]]:
        a_started, b_done = anyio.Event(), anyio.Event()
        results: dict[str, tuple[int, dict]] = {}

        async def body_a() -> AsyncIterator[bytes]:
            yield purpose_part() + file_head()
            a_started.set()                    # A has checked the quota: 250 bytes free
            yield b"a" * 100
            await b_done.wait()
            yield b"a" * 100
            yield TAIL

        async def run_a() -> None:
            results["a"] = await post_streamed(client, key, body_a())

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(run_a)
            await a_started.wait()
            results["b"] = await post_streamed(client, key, body_of(
                [purpose_part() + file_head(), b"b" * 200, TAIL]))
            b_done.set()
        return results["a"], results["b"]

    (status_a, body_a), (status_b, body_b) = client.portal.call(race)
    assert status_b == 200, body_b
    assert status_a == 413 and body_a["error"]["code"] == "storage_quota_exceeded", body_a
    assert "This file of 200 bytes" in body_a["error"]["message"]
    assert os.listdir(files_dir) == [body_b["id"]]
    assert [f["id"] for f in client.get("/v1/files", headers=auth(key)).json()["data"]] == [body_b["id"]]
