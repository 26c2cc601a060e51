"""`rein batch submit|status|cancel`: OpenAI batch jobs on a running rein, over HTTP.

A client, not a server: it talks to `rein api` (base URL from `--base-url`, else
REIN_API_HOST/REIN_API_PORT) with a key from `--api-key` or REIN_API_KEY, through the Files
and Batches endpoints OpenAI's own client uses. `submit` uploads the input file
(purpose "batch"), creates the batch and prints its id alone on stdout, so
`ID=$(rein batch submit in.jsonl)` captures it; with `--wait` it follows request_counts on a
progress bar (stderr) and downloads the output file and, when some requests failed, the
error file. Exit codes: 0 done, 1 the batch ended failed/expired/cancelled, 2 the request
could not be made (no server, bad key, bad file, an API error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rein.core.settings import SettingsError, load_settings

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TERMINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
DEFAULT_POLL_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 10.0
# Uploads and downloads of large files take a while; a status call answers in milliseconds.
TRANSFER_TIMEOUT_SECONDS = 600.0


class BatchCLIError(Exception):
    """A request that could not be made or was refused; the message says what to change."""


# -- the HTTP client --------------------------------------------------------------------------


class BatchClient:
    """The few Files and Batches calls the CLI makes, with errors turned into BatchCLIError."""

    def __init__(self, base_url: str, api_key: str) -> None:
        import httpx

        self.base_url = base_url
        self._http = httpx.Client(
            base_url=base_url, headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(TRANSFER_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as fh:
            return self._json("POST", "/v1/files", files={"file": (path.name, fh, "application/jsonl")},
                              data={"purpose": "batch"})

    def create_batch(self, input_file_id: str, endpoint: str, window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:
        body: dict[str, Any] = {"input_file_id": input_file_id, "endpoint": endpoint,
                                "completion_window": window}
        if metadata:
            body["metadata"] = metadata
        return self._json("POST", "/v1/batches", json=body)

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/batches/{batch_id}")

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/batches/{batch_id}/cancel")

    def download(self, file_id: str, dest: Path) -> int:
        """Streams a file's content to `dest` (through a temporary name); returns its bytes."""
        partial = dest.with_name(dest.name + ".part")
        written = 0
        with self._request_stream("GET", f"/v1/files/{file_id}/content") as response, \
                partial.open("wb") as out:
            for chunk in response.iter_bytes():
                out.write(chunk)
                written += len(chunk)
        partial.replace(dest)
        return written

    # --- plumbing

    def _json(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        with self._request_stream(method, path, **kwargs) as response:
            response.read()
            try:
                return response.json()
            except ValueError:
                raise BatchCLIError(f"{method} {path}: the server at {self.base_url} did not answer "
                                    f"JSON (is it rein?): {response.text[:200]!r}") from None

    @contextlib.contextmanager
    def _request_stream(self, method: str, path: str, **kwargs: Any) -> Iterator[Any]:
        """An open httpx response with a 2xx status; every failure becomes a BatchCLIError."""
        import httpx

        try:
            with self._http.stream(method, path, **kwargs) as response:
                if response.status_code >= 400:
                    response.read()
                    raise BatchCLIError(self._describe_error(method, path, response))
                yield response
        except httpx.ConnectError as exc:
            raise BatchCLIError(
                f"cannot reach rein at {self.base_url} ({exc}): is `rein api` running there? "
                "Point --base-url (or REIN_API_HOST/REIN_API_PORT) at it.") from None
        except httpx.TimeoutException as exc:
            raise BatchCLIError(f"{method} {path}: rein at {self.base_url} did not answer in time "
                                f"({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise BatchCLIError(f"{method} {path}: {exc}") from None

    def _describe_error(self, method: str, path: str, response) -> str:
        try:
            error = response.json()["error"]
            message = error.get("message") or response.text
        except (ValueError, KeyError, TypeError):
            message = response.text[:300] or response.reason_phrase
        status = response.status_code
        if status == 401:
            return (f"rein rejected the API key (401: {message}). Pass a valid key with --api-key "
                    "or set REIN_API_KEY (create one with `rein keys create --scopes batch`).")
        if status == 403:
            return f"{message} (403): use a key created with the `batch` scope."
        return f"{method} {path} answered {status}: {message}"


# -- the command line -------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("batch", help="submit, follow and cancel batches on a running rein",
                                   description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--base-url", metavar="URL", default=None,
                        help="rein's address, e.g. http://127.0.0.1:8000 "
                             "(default: http://REIN_API_HOST:REIN_API_PORT)")
    common.add_argument("--api-key", metavar="KEY", default=None,
                        help="a key with the batch scope (default: REIN_API_KEY)")

    submit = actions.add_parser("submit", parents=[common], help="upload a batch input file and create a batch",
                                description="Upload FILE (OpenAI batch input: one request per line) and "
                                            "create a batch; prints the batch id.")
    submit.add_argument("file", metavar="FILE", help="batch input file (.jsonl)")
    submit.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/chat/completions",
                        help="the endpoint every line calls (default /v1/chat/completions)")
    submit.add_argument("--window", default="24h", metavar="WINDOW",
                        help="completion window (default 24h)")
    submit.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE",
                        help="a metadata pair kept with the batch (repeatable)")
    submit.add_argument("--wait", action="store_true",
                        help="show progress until the batch ends, then download its output")
    submit.add_argument("-o", "--output", default=None, metavar="OUT.jsonl",
                        help="with --wait: where the output goes (default: FILE's name + .output.jsonl)")
    submit.add_argument("--errors", default=None, metavar="ERR.jsonl",
                        help="with --wait: where the error lines go (default: OUT's name + .errors.jsonl)")
    submit.add_argument("--poll-interval", type=float, default=DEFAULT_POLL_SECONDS, metavar="S",
                        help=f"seconds between status checks with --wait (default {DEFAULT_POLL_SECONDS:g})")
    submit.add_argument("--no-progress", action="store_true", help="no progress bar")
    submit.set_defaults(func=_guard(run_submit))

    status = actions.add_parser("status", parents=[common], help="show a batch")
    status.add_argument("batch_id", metavar="ID")
    status.add_argument("--json", action="store_true", help="print the batch object as JSON")
    status.set_defaults(func=_guard(run_status))

    cancel = actions.add_parser("cancel", parents=[common], help="cancel a batch")
    cancel.add_argument("batch_id", metavar="ID")
    cancel.add_argument("--json", action="store_true", help="print the batch object as JSON")
    cancel.set_defaults(func=_guard(run_cancel))


def _guard(action):
    def run(args: argparse.Namespace) -> int:
        try:
            return action(args)
        except (BatchCLIError, SettingsError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return run


def _client(args: argparse.Namespace) -> BatchClient:
    settings = load_settings()
    base_url = args.base_url
    if not base_url:
        # An API listening on every interface is reached on loopback from here.
        host = "127.0.0.1" if settings.api_host in ("0.0.0.0", "::", "") else settings.api_host
        host = f"[{host}]" if ":" in host else host
        base_url = f"http://{host}:{settings.api_port}"
    base_url = base_url.rstrip("/").removesuffix("/v1")   # the openai client's form works too
    if not base_url.startswith(("http://", "https://")):
        raise BatchCLIError(f"--base-url must start with http:// or https://, got {base_url!r}")
    key = args.api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
    if not key:
        raise BatchCLIError("no API key: pass --api-key or set REIN_API_KEY "
                            "(create one with `rein keys create --name me --scopes batch`)")
    return BatchClient(base_url, key)


def _parse_metadata(pairs: list[str]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BatchCLIError(f"--metadata takes KEY=VALUE, got {pair!r}")
        metadata[key] = value
    return metadata


def run_submit(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise BatchCLIError(f"input file {path} does not exist (or is not a file)")
    if path.stat().st_size == 0:
        raise BatchCLIError(f"input file {path} is empty: a batch needs at least one request line")
    if (args.output or args.errors) and not args.wait:
        raise BatchCLIError("-o/--output and --errors only apply with --wait (the output exists "
                            "once the batch completes)")
    if args.poll_interval <= 0:
        raise BatchCLIError(f"--poll-interval must be positive, got {args.poll_interval:g}")
    metadata = _parse_metadata(args.metadata)
    with _client(args) as client:
        uploaded = client.upload(path)
        print(f"uploaded {path} as {uploaded['id']} ({uploaded.get('bytes', '?')} bytes)", file=sys.stderr)
        batch = client.create_batch(uploaded["id"], args.endpoint, args.window, metadata)
        print(batch["id"], flush=True)
        if not args.wait:
            print(f"follow it with `rein batch status {batch['id']}`", file=sys.stderr)
            return 0
        output = Path(args.output) if args.output else path.with_name(path.stem + ".output.jsonl")
        errors = Path(args.errors) if args.errors else output.with_name(
            output.name.removesuffix(".jsonl") + ".errors.jsonl")
        try:
            batch = wait_for_batch(client, batch, args.poll_interval, progress=not args.no_progress)
        except KeyboardInterrupt:
            print(f"\nstopped waiting; the batch keeps running: `rein batch status {batch['id']}`",
                  file=sys.stderr)
            return 130
        return _finish(client, batch, output, errors)


def wait_for_batch(client: BatchClient, batch: dict[str, Any], poll_seconds: float,
                   progress: bool = True) -> dict[str, Any]:
    """Polls the batch until it reaches a terminal status, showing request_counts on a bar."""
    from tqdm import tqdm

    with tqdm(total=None, unit="req", desc=batch["status"], disable=not progress,
              file=sys.stderr, dynamic_ncols=True) as bar:
        while True:
            counts = batch.get("request_counts") or {}
            total = counts.get("total") or 0
            if total and bar.total != total:
                bar.total = total
            done = (counts.get("completed") or 0) + (counts.get("failed") or 0)
            bar.update(done - bar.n)
            bar.set_description(batch["status"], refresh=False)
            bar.set_postfix(failed=counts.get("failed") or 0, refresh=True)
            if batch["status"] in TERMINAL_STATUSES:
                return batch
            time.sleep(poll_seconds)
            batch = client.batch(batch["id"])


def _finish(client: BatchClient, batch: dict[str, Any], output: Path, errors: Path) -> int:
    print(describe(batch), file=sys.stderr)
    if batch.get("output_file_id"):
        size = client.download(batch["output_file_id"], output)
        print(f"output: {output} ({size} bytes)", file=sys.stderr)
    if batch.get("error_file_id"):
        size = client.download(batch["error_file_id"], errors)
        print(f"errors: {errors} ({size} bytes)", file=sys.stderr)
    return 0 if batch["status"] == "completed" else 1


def run_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        batch = client.batch(args.batch_id)
    print(json.dumps(batch, indent=2) if args.json else describe(batch))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        batch = client.cancel(args.batch_id)
    print(json.dumps(batch, indent=2) if args.json else describe(batch))
    return 0


def describe(batch: dict[str, Any]) -> str:
    """A batch object as a few lines for people."""
    counts = batch.get("request_counts") or {}
    lines = [f"{batch['id']}  {batch.get('status')}  {batch.get('endpoint', '')}  "
             f"window {batch.get('completion_window', '?')}",
             f"  requests: {counts.get('total', 0)} total, {counts.get('completed', 0)} completed, "
             f"{counts.get('failed', 0)} failed"]
    times = [(name, batch.get(f"{name}_at")) for name in
             ("created", "in_progress", "finalizing", "completed", "failed", "expired",
              "cancelling", "cancelled")]
    shown = [f"{name} {_when(at)}" for name, at in times if at]
    if shown:
        lines.append("  " + ", ".join(shown))
    files = [(label, batch.get(f"{label}_file_id")) for label in ("input", "output", "error")]
    lines.append("  files: " + ", ".join(f"{label} {fid}" for label, fid in files if fid))
    errors = (batch.get("errors") or {}).get("data") or []
    for error in errors[:5]:
        where = f" (line {error['line']})" if error.get("line") is not None else ""
        lines.append(f"  error{where}: {error.get('message')}")
    if len(errors) > 5:
        lines.append(f"  ... and {len(errors) - 5} more errors")
    return "\n".join(lines)


def _when(timestamp: int) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
