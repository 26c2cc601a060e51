"""The FileStore contract on S3-compatible object storage (rein.store.s3), against moto's HTTP
server (tests/conftest.py's s3_server): what LocalFileStore does, S3FileStore does, and a file
being written is invisible until its commit, in several multipart parts."""

from __future__ import annotations

import os

import pytest

from rein.core.settings import Settings
from rein.store.filestore import FileTooLargeError, filestore_for
from rein.store.s3 import MIN_PART_BYTES, S3FileStore, s3_client


@pytest.fixture
def store(s3_bucket: str) -> S3FileStore:
    return S3FileStore(f"s3://{s3_bucket}/files/", part_bytes=MIN_PART_BYTES)


def _keys(bucket: str) -> list[str]:
    return [item["Key"] for item in s3_client().list_objects_v2(Bucket=bucket).get("Contents", [])]


def _uploads(bucket: str) -> list[str]:
    return [item["Key"] for item in s3_client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_settings_pick_the_store(s3_bucket, tmp_path):
    assert isinstance(filestore_for(Settings(files_url=f"s3://{s3_bucket}/p", models=())), S3FileStore)
    local = filestore_for(Settings(files_dir=str(tmp_path), models=()))
    assert local.root == tmp_path
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        filestore_for(Settings(files_url="gs://bucket/p", models=()))


def test_save_open_size_delete(store, s3_bucket):
    assert store.save("file-a", [b"one\n", b"two\n"]) == 8
    assert _keys(s3_bucket) == ["files/file-a"]
    with store.open("file-a") as f:
        assert f.readline() == b"one\n"
        assert list(f) == [b"two\n"]
    assert store.size("file-a") == 8
    store.delete("file-a")
    store.delete("file-a")                       # no error when already gone
    with pytest.raises(FileNotFoundError):
        store.open("file-a")
    with pytest.raises(FileNotFoundError):
        store.size("file-a")
    with pytest.raises(ValueError):
        store.open("../x")


def test_too_large_stores_nothing(store, s3_bucket):
    with pytest.raises(FileTooLargeError):
        store.save("big", [b"x" * 600, b"y" * 600], max_bytes=1000)
    chunk = os.urandom(1024 * 1024)
    with pytest.raises(FileTooLargeError):       # past a part already uploaded: the upload is aborted
        store.save("bigger", [chunk] * 7, max_bytes=6 * 1024 * 1024)
    assert _keys(s3_bucket) == [] and _uploads(s3_bucket) == []


def test_multipart_invisible_until_commit(store, s3_bucket):
    data = os.urandom(MIN_PART_BYTES * 2 + 12345)       # three parts, the last a short one
    new = store.create("multi")
    for start in range(0, len(data), 1 << 20):
        new.write(data[start:start + (1 << 20)])
    assert new.size == len(data)
    assert _uploads(s3_bucket) == ["files/multi"]       # parts went up as they filled
    assert _keys(s3_bucket) == []                       # and nothing is visible yet
    with pytest.raises(FileNotFoundError):
        store.open("multi")
    assert new.commit() == len(data)
    new.discard()                                       # a no-op once committed
    assert _uploads(s3_bucket) == []
    assert store.size("multi") == len(data)
    with store.open("multi") as f:
        assert f.read() == data


def test_discard_aborts(store, s3_bucket):
    new = store.create("dropped")
    new.write(os.urandom(MIN_PART_BYTES + 1))
    assert _uploads(s3_bucket) == ["files/dropped"]
    new.discard()
    new.discard()
    assert _uploads(s3_bucket) == [] and _keys(s3_bucket) == []


def test_writer_commits_or_drops(store, s3_bucket):
    with store.writer("out") as out:
        out.write("línea 1\n")
        out.flush()
        assert _keys(s3_bucket) == []
        out.write("line 2\n")
    with store.open("out") as f:
        assert f.read().decode() == "línea 1\nline 2\n"
    with pytest.raises(RuntimeError), store.writer("out") as out:
        out.write("replaced?\n")
        raise RuntimeError("boom")
    with store.open("out") as f:                        # the failed rewrite left the old file
        assert f.read().decode() == "línea 1\nline 2\n"
    with store.writer("out") as out:                    # a rewrite replaces it
        out.write("new\n")
    assert store.size("out") == 4
