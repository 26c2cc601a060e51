"""Where `rein run-batch` reads and writes: a local path, or a URL, as vLLM's run-batch takes them.

Input: a path, `s3://bucket/key` (S3-compatible object storage, rein.store.s3: endpoint and
credentials from the standard AWS_* variables) or `https://` / `http://` (a plain GET). Output
and errors: a path or `s3://bucket/key` (a multipart upload, parts sent as they fill, completed
when the run ends); an https output would need a server that takes uploads, which has no common
protocol, so it is refused with a clear error. Everything streams: nothing holds a whole file.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

REMOTE_INPUT = ("s3://", "https://", "http://")
REMOTE_OUTPUT = ("s3://",)


def is_remote(location: str | Path) -> bool:
    return "://" in str(location)


def check_input(location: str | Path) -> None:
    """ValueError naming what is wrong with an input location (a missing local file, a scheme
    not read)."""
    text = str(location)
    if is_remote(text):
        if not text.startswith(REMOTE_INPUT):
            raise ValueError(f"input {text}: want a local path, s3://bucket/key, https:// or http:// URL")
    elif not Path(text).is_file():
        raise ValueError(f"input file {text} does not exist")


def check_output(location: str | Path) -> None:
    """ValueError when run-batch cannot write to `location` (only paths and s3:// URLs)."""
    text = str(location)
    if is_remote(text) and not text.startswith(REMOTE_OUTPUT):
        raise ValueError(f"output {text}: want a local path or s3://bucket/key (an https:// output is not "
                         "supported: write to a path or to object storage and publish it from there)")


def _object(url: str) -> tuple[str, str]:
    from rein.store.s3 import parse_s3_url

    bucket, key = parse_s3_url(url)
    if not key:
        raise ValueError(f"{url}: names a bucket, not an object: want s3://bucket/key")
    return bucket, key


@contextmanager
def open_input(location: str | Path) -> Iterator[IO[bytes]]:
    """The input's bytes, streamed (FileNotFoundError when it does not exist)."""
    text = str(location)
    check_input(text)
    if text.startswith("s3://"):
        from rein.store.s3 import open_object, s3_client

        source = open_object(s3_client(), *_object(text))
    elif is_remote(text):
        try:
            source = urllib.request.urlopen(text, timeout=60)   # noqa: S310 (the scheme was checked)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise FileNotFoundError(f"input {text}: 404 Not Found") from None
            raise OSError(f"input {text}: HTTP {exc.code} {exc.reason}") from None
    else:
        source = open(text, "rb")  # noqa: SIM115 (closed below)
    with source:
        yield source


@contextmanager
def open_output(location: str | Path) -> Iterator[IO[str]]:
    """A text file to write `location`. Like a local file, an s3:// output keeps what was written
    when the run stops early (an interrupt, an error): the upload is completed then too."""
    text = str(location)
    check_output(text)
    if text.startswith("s3://"):
        from rein.store.s3 import ObjectUpload, s3_client, text_writer

        with text_writer(ObjectUpload(s3_client(), *_object(text)), commit_on_error=True) as out:
            yield out
    else:
        with open(text, "w", encoding="utf-8") as out:
            yield out
