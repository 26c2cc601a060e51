"""Two API apps on different hosts' directories sharing one S3 store (REIN_FILES_URL=s3://...,
against moto's HTTP server): a file uploaded through one is a batch's input through the other,
whose output and error files the first serves; a deleted file is gone for both."""

from __future__ import annotations

import io

import pytest
from api_support import auth, jsonl, line
from sqlalchemy import select
from support import wait_for
from test_batches import FAST, batch_jobs, fail_job, get, jsonl_lines, upload, wait_status

from rein.store.s3 import s3_client
from rein.store.tables import File

pytestmark = pytest.mark.usefixtures("end_leftover_batches")


def test_two_apps_share_one_bucket(make_client, make_key, tenant, tmp_path, s3_bucket, fake_worker,
                                   db_sessionmaker):
    url = f"s3://{s3_bucket}/rein/files"
    first = make_client(files_dir=str(tmp_path / "host-a"), files_url=url, **FAST)
    second = make_client(files_dir=str(tmp_path / "host-b"), files_url=url, **FAST)
    key = make_key(tenant, "batch,inference")
    content = jsonl(line("first", "one"), line("second", "two"))

    file_id = upload(first, key, content)
    stored = s3_client().list_objects_v2(Bucket=s3_bucket)["Contents"]
    assert [item["Key"] for item in stored] == [f"rein/files/{file_id}"]
    assert not (tmp_path / "host-a").exists() and not (tmp_path / "host-b").exists()   # nothing local
    assert second.get(f"/v1/files/{file_id}/content", headers=auth(key)).content == content

    response = second.post("/v1/batches", headers=auth(key), json={
        "input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"})
    assert response.status_code == 200, response.text
    batch_id = response.json()["id"]
    wait_status(second, key, batch_id, "in_progress")
    jobs = wait_for(lambda: (js := batch_jobs(db_sessionmaker, batch_id)) and all(j.sent_at for j in js) and js,
                    10, "every job sent")
    fake_worker.record(jobs[0].id, "one done", [7])
    fail_job(db_sessionmaker, jobs[1].id)
    done = wait_status(first, key, batch_id, "completed")

    output = jsonl_lines(first.get(f"/v1/files/{done['output_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in output] == ["first"]
    assert output[0]["response"]["body"]["choices"][0]["text"] == "one done"
    errors = jsonl_lines(second.get(f"/v1/files/{done['error_file_id']}/content", headers=auth(key)))
    assert [x["custom_id"] for x in errors] == ["second"]
    with db_sessionmaker() as session:    # the sizes recorded are the objects' sizes
        row = session.scalars(select(File).where(File.id == done["output_file_id"])).one()
    head = s3_client().head_object(Bucket=s3_bucket, Key=f"rein/files/{done['output_file_id']}")
    assert row.bytes == head["ContentLength"] > 0

    assert get(first, key, batch_id)["status"] == "completed"
    assert first.delete(f"/v1/files/{file_id}", headers=auth(key)).status_code == 200
    assert second.get(f"/v1/files/{file_id}/content", headers=auth(key)).status_code == 404
    keys = [item["Key"] for item in s3_client().list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert f"rein/files/{file_id}" not in keys


def test_upload_past_the_limit_leaves_nothing_in_the_bucket(make_client, make_key, tenant, tmp_path, s3_bucket):
    """An upload refused at REIN_MAX_FILE_BYTES after a multipart part went up: 413 as with a
    local directory, the upload aborted, no object; a file whose object is gone is a 404."""
    client = make_client(files_dir=str(tmp_path / "files"), files_url=f"s3://{s3_bucket}/f",
                         max_file_bytes=9 * 1024 * 1024)
    key = make_key(tenant, "batch")
    content = (b"x" * 1023 + b"\n") * (10 * 1024)              # 10 MiB: one 8 MiB part, then refused
    response = client.post("/v1/files", headers=auth(key), data={"purpose": "batch"},
                           files={"file": ("in.jsonl", io.BytesIO(content), "application/jsonl")})
    assert response.status_code == 413 and response.json()["error"]["code"] == "file_too_large"
    assert s3_client().list_objects_v2(Bucket=s3_bucket).get("Contents", []) == []
    assert s3_client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []

    file_id = upload(client, key, b'{"a": 1}\n')
    s3_client().delete_object(Bucket=s3_bucket, Key=f"f/{file_id}")
    missing = client.get(f"/v1/files/{file_id}/content", headers=auth(key))
    assert missing.status_code == 404 and "missing from storage" in missing.json()["error"]["message"]


def test_an_expired_file_is_deleted_from_the_bucket(make_client, make_key, tenant, tmp_path, s3_bucket,
                                                    db_sessionmaker):
    """The expiry sweep of the API process deletes an expired file's object from S3, and its row."""
    from sqlalchemy import func, update

    client = make_client(files_dir=str(tmp_path / "host"), files_url=f"s3://{s3_bucket}/rein/files",
                         retention_interval_seconds=0.1)
    key = make_key(tenant, "batch")
    expiring, staying = upload(client, key, jsonl(line("a"))), upload(client, key, jsonl(line("b")))

    def objects() -> list[str]:
        return sorted(item["Key"] for item in s3_client().list_objects_v2(Bucket=s3_bucket).get("Contents", []))

    assert objects() == sorted([f"rein/files/{expiring}", f"rein/files/{staying}"])
    with db_sessionmaker.begin() as session:
        session.execute(update(File).where(File.id == expiring).values(expires_at=func.now()))
    wait_for(lambda: objects() == [f"rein/files/{staying}"], 10, "the sweep to delete the expired object")
    assert client.get(f"/v1/files/{expiring}", headers=auth(key)).status_code == 404
    assert client.get(f"/v1/files/{expiring}/content", headers=auth(key)).status_code == 404
    assert client.get(f"/v1/files/{staying}/content", headers=auth(key)).status_code == 200
