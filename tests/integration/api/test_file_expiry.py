"""File expiry through the official openai client (rein.batches.expiry, rein.jobs.retention):
`expires_after` on an upload sets `expires_at`, out-of-range policies are refused, batch files
default to REIN_BATCH_FILE_EXPIRY_SECONDS, and a file past its `expires_at` is deleted by the
API process's sweep, bytes and row, answering 404 afterwards."""

from __future__ import annotations

import io
import os
import time

import pytest
from api_support import auth, jsonl, line
from sqlalchemy import func, update
from support import wait_for

from rein.store.tables import File

LINES = jsonl(line("a"), line("b"))
HOUR, THIRTY_DAYS = 3600, 2_592_000


def openai_client(http_client, key: str):
    from openai import OpenAI

    return OpenAI(api_key=key, base_url="http://testserver/v1", http_client=http_client, max_retries=0)


def test_expires_after_sets_expires_at(make_client, make_key, tenant, tmp_path):
    client = openai_client(make_client(files_dir=str(tmp_path / "files")), make_key(tenant, "batch"))
    hour = client.files.create(file=("in.jsonl", LINES), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": HOUR})
    assert hour.expires_at == hour.created_at + HOUR
    assert client.files.retrieve(hour.id).expires_at == hour.expires_at
    longest = client.files.create(file=("in.jsonl", LINES), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": THIRTY_DAYS})
    assert longest.expires_at == longest.created_at + THIRTY_DAYS
    # Without a policy a batch file expires after the default, OpenAI's 30 days.
    default = client.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert default.expires_at == default.created_at + THIRTY_DAYS
    assert {f.id: f.expires_at for f in client.files.list()} == {
        hour.id: hour.expires_at, longest.id: longest.expires_at, default.id: default.expires_at}


def test_the_default_is_configurable_and_zero_keeps_files(make_client, make_key, tenant, tmp_path):
    key = make_key(tenant, "batch")
    kept = openai_client(make_client(files_dir=str(tmp_path / "a"), batch_file_expiry_seconds=0), key)
    assert kept.files.create(file=("in.jsonl", LINES), purpose="batch").expires_at is None
    week = openai_client(make_client(files_dir=str(tmp_path / "b"), batch_file_expiry_seconds=7 * 86400), key)
    file = week.files.create(file=("in.jsonl", LINES), purpose="batch")
    assert file.expires_at == file.created_at + 7 * 86400
    # An explicit policy wins over the default, "never" included.
    asked = kept.files.create(file=("in.jsonl", LINES), purpose="batch",
                              expires_after={"anchor": "created_at", "seconds": HOUR})
    assert asked.expires_at == asked.created_at + HOUR


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "3599"}, "expires_after.seconds", "3600"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"}, "expires_after.seconds",
     "2592000"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1.5h"}, "expires_after.seconds",
     "whole number"),
    ({"expires_after[anchor]": "created_at"}, "expires_after.seconds", "whole number"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, "expires_after.anchor",
     "created_at"),
    ({"expires_after[seconds]": "3600"}, "expires_after.anchor", "created_at"),
])
def test_a_bad_policy_is_refused_and_nothing_is_stored(make_client, make_key, tenant, tmp_path, fields, param,
                                                       says):
    client = make_client(files_dir=str(tmp_path / "files"))
    key = make_key(tenant, "batch")
    response = client.post("/v1/files", headers=auth(key), data={"purpose": "batch", **fields},
                           files={"file": ("in.jsonl", io.BytesIO(LINES), "application/jsonl")})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert client.get("/v1/files", headers=auth(key)).json()["data"] == []
    assert not (tmp_path / "files").exists() or os.listdir(tmp_path / "files") == []


def test_the_official_client_sees_its_own_range_refused(make_client, make_key, tenant, tmp_path):
    from openai import BadRequestError

    client = openai_client(make_client(files_dir=str(tmp_path / "files")), make_key(tenant, "batch"))
    with pytest.raises(BadRequestError) as refused:
        client.files.create(file=("in.jsonl", LINES), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})
    assert "3600" in refused.value.message and refused.value.param == "expires_after.seconds"


def test_an_expired_file_is_swept_by_the_api_process(make_client, make_key, tenant, tmp_path, db_sessionmaker):
    """The clock moved forward (the row's expires_at set into the past): the API process's own
    retention loop deletes the stored bytes and the row, and the file answers 404."""
    from openai import NotFoundError

    files = tmp_path / "files"
    http = make_client(files_dir=str(files), retention_interval_seconds=0.1)
    key = make_key(tenant, "batch")
    client = openai_client(http, key)
    expiring = client.files.create(file=("in.jsonl", LINES), purpose="batch",
                                   expires_after={"anchor": "created_at", "seconds": HOUR})
    staying = client.files.create(file=("in.jsonl", LINES), purpose="batch",
                                  expires_after={"anchor": "created_at", "seconds": HOUR})
    assert sorted(os.listdir(files)) == sorted([expiring.id, staying.id])
    time.sleep(0.3)                   # a few passes of the loop: nothing is due yet
    assert client.files.content(expiring.id).content == LINES

    with db_sessionmaker.begin() as session:
        session.execute(update(File).where(File.id == expiring.id)
                        .values(expires_at=func.now() - func.make_interval(0, 0, 0, 0, 0, 0, 1)))
    wait_for(lambda: expiring.id not in os.listdir(files), 10, "the sweep to delete the expired file's bytes")
    with pytest.raises(NotFoundError):
        client.files.retrieve(expiring.id)
    assert http.get(f"/v1/files/{expiring.id}/content", headers=auth(key)).status_code == 404
    assert [f.id for f in client.files.list()] == [staying.id]
    assert os.listdir(files) == [staying.id]
    assert client.files.content(staying.id).content == LINES


def test_an_expired_file_is_not_found_before_the_sweep_runs(make_client, make_key, tenant, tmp_path,
                                                            db_sessionmaker):
    """Past its expires_at a file answers 404 at once (reads, list, a new batch from it); the sweep
    then deletes what is stored."""
    from openai import NotFoundError

    from rein.jobs.retention import expire_once

    files = tmp_path / "files"
    http = make_client(files_dir=str(files))        # the API's own sweep: not for an hour
    key = make_key(tenant, "batch")
    client = openai_client(http, key)
    file = client.files.create(file=("in.jsonl", LINES), purpose="batch")
    with db_sessionmaker.begin() as session:
        session.execute(update(File).where(File.id == file.id).values(expires_at=func.now()))
    with pytest.raises(NotFoundError):
        client.files.retrieve(file.id)
    with pytest.raises(NotFoundError):
        client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    assert http.get(f"/v1/files/{file.id}/content", headers=auth(key)).status_code == 404
    assert list(client.files.list()) == []
    assert os.listdir(files) == [file.id]           # still stored: the sweep has not run

    report = expire_once(http.app.state.settings, db_sessionmaker, http.app.state.filestore)
    assert report.files >= 1 and os.listdir(files) == []
    with db_sessionmaker() as session:
        assert session.get(File, file.id) is None
