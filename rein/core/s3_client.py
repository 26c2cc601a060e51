"""The one boto3 S3 client of a process and the s3:// URL parser, in the lowest layer so that
the model layer (LoRA adapters on object storage, rein.model.lora.fetch) and the store
(rein.store.s3) share them.

The endpoint and credentials are the standard variables every S3 tool reads (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION and the rest of the AWS chain): botocore
reads them itself.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import urlparse

# HTTP connections the client keeps: concurrent downloads, uploads and the batch manager share them.
MAX_CONNECTIONS = 32

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def s3_client() -> Any:
    """A boto3 S3 client configured from the standard AWS_* variables (one per process; boto3
    clients are thread-safe)."""
    with _clients_lock:
        if "s3" not in _clients:
            import boto3
            from botocore.config import Config

            _clients["s3"] = boto3.session.Session().client(
                "s3", config=Config(max_pool_connections=MAX_CONNECTIONS, retries={"mode": "standard"}))
        return _clients["s3"]


def parse_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> ("bucket", "some/key") (the key without leading or trailing /)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3:// URL: {url!r}: want s3://bucket/key")
    return parsed.netloc, parsed.path.strip("/")
