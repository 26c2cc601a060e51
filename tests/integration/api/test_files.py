"""The Files API against real Postgres and Redis: upload, list, read, delete, limits, scopes,
tenant isolation, and the official openai client on the same routes."""

from __future__ import annotations

import io
import json
import os

import pytest
from api_support import auth

LINES = b"".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": f"p{i}", "max_tokens": 2}}).encode() + b"\n"
                 for i in range(3))


@pytest.fixture
def files_client(make_client, tmp_path):
    return make_client(files_dir=str(tmp_path / "files"))


def upload(client, key: str, content: bytes = LINES, purpose: str = "batch", name: str = "in.jsonl"):
    return client.post("/v1/files", headers=auth(key), data={"purpose": purpose},
                       files={"file": (name, io.BytesIO(content), "application/jsonl")})


def test_upload_get_list_content_delete(files_client, make_key, tenant, tmp_path):
    key = make_key(tenant, "batch")
    response = upload(files_client, key)
    assert response.status_code == 200, response.text
    file = response.json()
    assert file["object"] == "file" and file["id"].startswith("file-")
    assert (file["bytes"], file["filename"], file["purpose"], file["status"]) == (len(LINES), "in.jsonl",
                                                                                 "batch", "processed")
    assert files_client.get(f"/v1/files/{file['id']}", headers=auth(key)).json() == file
    content = files_client.get(f"/v1/files/{file['id']}/content", headers=auth(key))
    assert content.status_code == 200 and content.content == LINES
    listed = files_client.get("/v1/files", headers=auth(key)).json()
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [file["id"]]
    assert os.listdir(tmp_path / "files") == [file["id"]]

    deleted = files_client.delete(f"/v1/files/{file['id']}", headers=auth(key))
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert files_client.get(f"/v1/files/{file['id']}", headers=auth(key)).status_code == 404
    assert files_client.get(f"/v1/files/{file['id']}/content", headers=auth(key)).status_code == 404
    assert files_client.delete(f"/v1/files/{file['id']}", headers=auth(key)).status_code == 404
    assert os.listdir(tmp_path / "files") == []


def test_list_pages_newest_first(files_client, make_key, tenant):
    key = make_key(tenant, "batch")
    ids = [upload(files_client, key, name=f"f{i}.jsonl").json()["id"] for i in range(3)]
    first = files_client.get("/v1/files", headers=auth(key), params={"limit": 2}).json()
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"]
    second = files_client.get("/v1/files", headers=auth(key),
                              params={"limit": 2, "after": first["last_id"]}).json()
    assert [f["id"] for f in second["data"]] == [ids[0]] and not second["has_more"]
    bad = files_client.get("/v1/files", headers=auth(key), params={"after": "file-nope"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    everything = files_client.get("/v1/files", headers=auth(key)).json()     # OpenAI's default page: 10,000
    assert [f["id"] for f in everything["data"]] == ids[::-1] and not everything["has_more"]
    oldest = files_client.get("/v1/files", headers=auth(key), params={"order": "asc", "limit": 2}).json()
    assert [f["id"] for f in oldest["data"]] == ids[:2] and oldest["has_more"]
    rest = files_client.get("/v1/files", headers=auth(key),
                            params={"order": "asc", "after": oldest["last_id"]}).json()
    assert [f["id"] for f in rest["data"]] == [ids[2]] and not rest["has_more"]
    assert files_client.get("/v1/files", headers=auth(key), params={"order": "up"}).status_code == 400


def test_too_large_is_refused_and_nothing_is_kept(make_client, make_key, tenant, tmp_path):
    client = make_client(files_dir=str(tmp_path / "files"), max_file_bytes=100)
    key = make_key(tenant, "batch")
    # Content-Length within the multipart slack: refused while streaming to storage.
    response = upload(client, key, content=b"x" * 101)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "file_too_large" and "100 bytes" in error["message"]
    # Content-Length past limit + slack: refused before the body is read.
    assert upload(client, key, content=b"x" * 200_000).status_code == 413
    assert upload(client, key, content=b"x" * 100).status_code == 200
    assert len(client.get("/v1/files", headers=auth(key)).json()["data"]) == 1
    assert len(os.listdir(tmp_path / "files")) == 1


def test_bad_requests(files_client, make_key, tenant):
    key = make_key(tenant, "batch")
    response = upload(files_client, key, purpose="fine-tune")
    assert response.status_code == 400 and response.json()["error"]["param"] == "purpose"
    response = files_client.post("/v1/files", headers=auth(key), data={"purpose": "batch"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    response = files_client.post("/v1/files", headers=auth(key), json={"purpose": "batch"})
    assert response.status_code == 400


def test_batch_scope_is_required(files_client, make_key, tenant):
    key = make_key(tenant, "inference,usage")
    response = upload(files_client, key)
    assert response.status_code == 403
    assert response.json()["error"]["message"] == "API scope is not declared: batch"
    assert files_client.get("/v1/files", headers=auth(key)).status_code == 403
    assert files_client.get("/v1/files").status_code == 401


def test_tenant_isolation(files_client, make_key, tenant):
    mine, theirs = make_key(tenant, "batch"), make_key(f"{tenant}-other", "batch")
    file_id = upload(files_client, mine).json()["id"]
    assert files_client.get(f"/v1/files/{file_id}", headers=auth(theirs)).status_code == 404
    assert files_client.get(f"/v1/files/{file_id}/content", headers=auth(theirs)).status_code == 404
    assert files_client.delete(f"/v1/files/{file_id}", headers=auth(theirs)).status_code == 404
    assert files_client.get("/v1/files", headers=auth(theirs)).json()["data"] == []
    assert files_client.get(f"/v1/files/{file_id}", headers=auth(mine)).status_code == 200


def test_official_openai_client(files_client, make_key, tenant):
    from openai import NotFoundError, OpenAI

    client = OpenAI(api_key=make_key(tenant, "batch"), base_url="http://testserver/v1",
                    http_client=files_client, max_retries=0)
    created = client.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert created.bytes == len(LINES) and created.purpose == "batch"
    assert client.files.retrieve(created.id).filename == "in.jsonl"
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.content(created.id).content == LINES
    assert client.files.delete(created.id).deleted
    with pytest.raises(NotFoundError):
        client.files.retrieve(created.id)
