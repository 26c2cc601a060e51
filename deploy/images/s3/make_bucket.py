"""compose.s3.yaml's one-shot `s3-bucket`, run from rein's image: REIN_FILES_URL's bucket,
created on the S3 server (AWS_ENDPOINT_URL) when it is missing, because `rein api` refuses to
start without it (rein.store.s3.check_files_url). Waits up to 60 s for the server to answer:
it may still be starting. Exits 1 with one line when the bucket cannot be had (another
owner's, or refused credentials). Running it again changes nothing."""

from __future__ import annotations

import os
import sys
import time

from botocore.exceptions import BotoCoreError, ClientError

from rein.store.s3 import parse_s3_url, s3_client

WAIT_S = 60.0


def main() -> int:
    bucket, _ = parse_s3_url(os.environ.get("REIN_FILES_URL", ""))
    client = s3_client()
    endpoint = client.meta.endpoint_url
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            client.head_bucket(Bucket=bucket)
            print(f"s3-bucket: {bucket} exists at {endpoint}", flush=True)
            return 0
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status != 404:
                print(f"s3-bucket: {bucket} at {endpoint} cannot be used: HTTP {status} "
                      f"(another owner's bucket, or credentials the server refuses)", file=sys.stderr)
                return 1
        except BotoCoreError as exc:    # not answering yet: connection refused, a timeout
            if time.monotonic() > deadline:
                print(f"s3-bucket: no answer from {endpoint} in {WAIT_S:.0f} s: {exc}", file=sys.stderr)
                return 1
            time.sleep(1)
            continue
        region = client.meta.region_name
        # Outside us-east-1, S3 wants the region named again (MinIO and moto accept either).
        config = {} if region in (None, "us-east-1") else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        client.create_bucket(Bucket=bucket, **config)
        print(f"s3-bucket: created {bucket} at {endpoint}", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
