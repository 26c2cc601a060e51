"""The API's startup check of REIN_FILES_URL=s3://... (rein.store.s3.check_bucket and
check_files_url), against moto's HTTP server (tests/conftest.py's s3_server).

An API whose bucket is missing or whose endpoint is wrong would start, answer /readyz, and
fail every upload and batch later; the check refuses it at startup with one line naming the
bucket, the endpoint, the S3 error and what to change. Checked here: a good bucket passes (a
prefix or none), a missing bucket and an endpoint nobody listens on each give that line, and a
local directory is never checked.
"""

from __future__ import annotations

import time

import pytest
from support import free_port

from rein.core.settings import Settings
from rein.store.s3 import BucketUnusableError, check_bucket, check_files_url


def _client(endpoint: str):
    """A client on `endpoint` that gives up at once: one attempt, a one-second connect timeout
    (the service's own client retries, which would only make these tests slow)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
        aws_secret_access_key="test",
        config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1, "mode": "standard"}))


def test_a_good_bucket_passes(s3_bucket: str) -> None:
    check_bucket(f"s3://{s3_bucket}/rein/files")
    check_bucket(f"s3://{s3_bucket}")                      # the bucket's root: no prefix
    check_files_url(Settings(files_url=f"s3://{s3_bucket}/files", models=()))


def test_a_missing_bucket_is_named_with_the_fix(s3_server: str, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}-missing/files"
    with pytest.raises(BucketUnusableError) as caught:
        check_files_url(Settings(files_url=url, models=()))     # the API's call, its own client
    message = str(caught.value)
    assert "\n" not in message
    assert f"bucket '{s3_bucket}-missing'" in message and s3_server in message
    assert "NoSuchBucket" in message and "create the bucket" in message


def test_an_unreachable_endpoint_says_connection_refused(s3_bucket: str) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"           # nothing listens there
    started = time.monotonic()
    with pytest.raises(BucketUnusableError) as caught:
        check_bucket(f"s3://{s3_bucket}/files", client=_client(endpoint))
    message = str(caught.value)
    assert time.monotonic() - started < 10
    assert "\n" not in message
    assert f"bucket '{s3_bucket}'" in message and endpoint in message
    assert "cannot connect" in message and "refused" in message.lower()
    assert "AWS_ENDPOINT_URL" in message


def test_bad_credentials_say_which_variables(s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # moto accepts any key unless told otherwise; an error it returns stands for AWS's.
    from botocore.exceptions import ClientError

    client = _client("http://unused.invalid")

    def denied(**_: object) -> None:
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "ListObjectsV2")

    monkeypatch.setattr(client, "list_objects_v2", denied)
    with pytest.raises(BucketUnusableError, match="AccessDenied .*AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        check_bucket(f"s3://{s3_bucket}/files", client=client)


def test_a_local_directory_is_not_checked(tmp_path) -> None:
    check_files_url(Settings(files_dir=str(tmp_path / "not-yet"), models=()))
    check_files_url(Settings(files_url=str(tmp_path / "files"), models=()))
    assert not (tmp_path / "not-yet").exists() and not (tmp_path / "files").exists()
