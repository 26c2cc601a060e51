"""LoRA adapters on object storage: an `s3://bucket/prefix` adapter path is fetched once per
machine into rein's cache and read from there, so a fleet's workers share one copy of each
adapter without a shared filesystem.

`local_adapter(path)` returns a local path for any adapter path: a local one as it is; an
`s3://` one downloaded to `<REIN_CACHE_DIR>/lora/<digest of the URL>/` (a PEFT directory: every
object under the prefix, sub-folders aside; a `.gguf` key: that one file). The download goes to
a temporary folder renamed into place when complete, so a reader never sees half an adapter and
two processes fetching the same URL at once both end with a whole one (the second rename loses
and its copy is dropped). A URL is fetched again only when its cache folder is missing: register
a changed adapter under a new URL (a versioned prefix), as its engine id is per name and path.

The endpoint and credentials are the standard AWS_* variables (rein.store.s3). Failures raise
AdapterError naming the URL and what S3 said, so the job fails with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
from pathlib import Path

from rein.core.settings import cache_root
from rein.model.lora.config import AdapterError

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"


def is_remote(path: str) -> bool:
    return path.startswith(S3_SCHEME)


def local_adapter(path: str) -> str:
    """A local path for the adapter at `path` (fetched into the cache when it is an s3:// URL)."""
    if not is_remote(path):
        return path
    from rein.core.s3_client import parse_s3_url

    try:
        bucket, key = parse_s3_url(path)
    except ValueError as exc:
        raise AdapterError(f"adapter path {path!r}: {exc}") from exc
    if not key:
        raise AdapterError(f"adapter path {path!r} names a bucket alone: give the adapter's prefix, "
                           f"s3://{bucket}/path/to/adapter")
    folder = cache_root() / "lora" / hashlib.sha256(path.encode()).hexdigest()[:24]
    name = key.rsplit("/", 1)[-1]
    target = folder / name if name.lower().endswith(".gguf") else folder
    if folder.is_dir():
        return str(target)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=folder.parent))
    try:
        count = _download(bucket, key, name, staging, path)
        try:
            staging.rename(folder)
        except OSError:          # another process put it there first: theirs is as good
            if not folder.is_dir():
                raise
        log.info("LoRA adapter %s fetched: %d file(s) into %s", path, count, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def _download(bucket: str, key: str, name: str, into: Path, url: str) -> int:
    """Download the adapter at bucket/key into `into`; the number of files."""
    from rein.core.s3_client import s3_client

    client = s3_client()
    try:
        if name.lower().endswith(".gguf"):
            client.download_file(bucket, key, str(into / name))
            return 1
        count = 0
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/"):
            for item in page.get("Contents", []):
                relative = item["Key"][len(key) + 1:]
                if not relative or "/" in relative:      # the adapter's own files, not sub-folders
                    continue
                client.download_file(bucket, item["Key"], str(into / relative))
                count += 1
    except Exception as exc:   # botocore's many errors: no such bucket, denied, unreachable
        raise AdapterError(f"adapter {url} could not be fetched ({type(exc).__name__}: {exc}): check the URL, "
                           f"the AWS_* credentials and AWS_ENDPOINT_URL of this process") from exc
    if count == 0:
        raise AdapterError(f"adapter {url}: nothing is stored under that prefix: upload the adapter's files "
                           f"(adapter_config.json, adapter_model.safetensors) there")
    return count
