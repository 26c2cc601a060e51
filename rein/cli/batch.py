"""`rein batch submit|status|list|cancel`: OpenAI batch jobs on a running rein, over HTTP.

A client, not a server: it talks to `rein api` (base URL from `--base-url`, else
REIN_API_HOST/REIN_API_PORT) with a key from `--api-key` or REIN_API_KEY, through the official
`openai` client on the Files and Batches endpoints. `submit` uploads the input file
(purpose "batch"), creates the batch and prints its id alone on stdout, so
`ID=$(rein batch submit in.jsonl)` captures it; with `--wait` it follows request_counts on a
progress bar (stderr) and downloads the output file and, when some requests failed, the
error file. `list` pages through the caller's batches. Exit codes: 0 done, 1 the batch ended
failed/expired/cancelled, 2 the request could not be made (no server, bad key, bad file, an
API error).

Every call is retried by the client (MAX_RETRIES times, with its backoff, honouring
Retry-After) on a connection error, a 429 or a 5xx: a single 503 from a restarting database
costs a few seconds, not the command. `--wait` goes further: while the API cannot be reached
or answers 5xx it keeps polling, backing off up to MAX_POLL_BACKOFF_SECONDS, for up to
`--max-outage` seconds in a row (an API restart or a rolling deploy), then gives up with
exit status 2; the batch itself keeps running on the server.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rein.core.settings import SettingsError, load_settings
from rein.openai.endpoints import BATCH_ENDPOINTS

ENDPOINTS = BATCH_ENDPOINTS
TERMINAL_STATUSES = ("completed", "failed", "expired", "cancelled")
DEFAULT_POLL_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 10.0
# Uploads and downloads of large files take a while; a status call answers in milliseconds.
TRANSFER_TIMEOUT_SECONDS = 600.0
# The client's own retries of one call (its backoff: 0.5 s doubling to 8 s, or Retry-After).
MAX_RETRIES = 4
DEFAULT_MAX_OUTAGE_SECONDS = 300.0
MAX_POLL_BACKOFF_SECONDS = 30.0
DOWNLOAD_CHUNK_BYTES = 1 << 20
LIST_PAGE_SIZE = 100          # GET /v1/batches' largest page


class BatchCLIError(Exception):
    """A request that could not be made or was refused; the message says what to change."""


class Unavailable(BatchCLIError):
    """rein could not be reached, or answered 5xx, after the client's retries: may pass."""


# -- the HTTP client --------------------------------------------------------------------------


class BatchClient:
    """The few Files and Batches calls the CLI makes, on the official `openai` client, with
    its errors turned into BatchCLIError. Objects come back as the JSON rein sent."""

    def __init__(self, base_url: str, api_key: str, max_retries: int = MAX_RETRIES,
                 http_client: Any = None) -> None:
        # Imported only where `rein batch` runs: `rein --help` stays quick.
        from openai import OpenAI, Timeout

        self.base_url = base_url
        self._openai = OpenAI(api_key=api_key, base_url=f"{base_url}/v1", max_retries=max_retries,
                              timeout=Timeout(TRANSFER_TIMEOUT_SECONDS, connect=CONNECT_TIMEOUT_SECONDS),
                              http_client=http_client)

    def close(self) -> None:
        self._openai.close()

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def upload(self, path: Path) -> dict[str, Any]:
        # A path (not an open file) so that a retry sends the whole file again.
        return self._call(lambda: self._openai.files.create(file=path, purpose="batch"))

    def create_batch(self, input_file_id: str, endpoint: str, window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:
        extra: dict[str, Any] = {"metadata": metadata} if metadata else {}
        return self._call(lambda: self._openai.batches.create(
            input_file_id=input_file_id, endpoint=endpoint, completion_window=window, **extra))

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self._call(lambda: self._openai.batches.retrieve(batch_id))

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._call(lambda: self._openai.batches.cancel(batch_id))

    def batches(self, page_size: int) -> Any:
        """Every batch of the caller, newest first, fetched a page at a time as it is read."""
        pages = self._call(lambda: self._openai.batches.list(limit=page_size), raw=True)
        iterator = iter(pages)
        while True:
            try:
                batch = self._call(lambda: next(iterator), raw=True)
            except StopIteration:
                return
            yield batch.to_dict(mode="json")

    def download(self, file_id: str, dest: Path) -> int:
        """Streams a file's content to `dest` (through a temporary name); returns its bytes."""
        partial = dest.with_name(dest.name + ".part")

        def fetch() -> int:
            written = 0
            with self._openai.files.with_streaming_response.content(file_id) as response, \
                    partial.open("wb") as out:
                for chunk in response.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                    out.write(chunk)
                    written += len(chunk)
            return written

        written = self._call(fetch, raw=True)
        partial.replace(dest)
        return written

    # --- plumbing

    def _call(self, call: Any, raw: bool = False) -> Any:
        """`call()`, its result as JSON (or as it is when `raw`); each failure a BatchCLIError."""
        import openai

        try:
            result = call()
        except openai.APITimeoutError as exc:
            raise Unavailable(f"{_what(exc)}: rein at {self.base_url} did not answer in time, "
                              f"{MAX_RETRIES + 1} tries") from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise Unavailable(f"cannot reach rein at {self.base_url} ({cause}) after {MAX_RETRIES + 1} tries: "
                              "is `rein api` running there? Point --base-url (or REIN_API_HOST/REIN_API_PORT) "
                              "at it.") from None
        except openai.APIStatusError as exc:
            message = self._describe_error(exc)
            raise (Unavailable(message) if exc.status_code >= 500 else BatchCLIError(message)) from None
        except openai.APIResponseValidationError as exc:
            raise BatchCLIError(f"{_what(exc)}: the server at {self.base_url} did not answer as rein does "
                                f"(is it rein?): {exc}") from None
        return result if raw else result.to_dict(mode="json")

    def _describe_error(self, exc: Any) -> str:
        body = exc.body if isinstance(exc.body, dict) else {}
        message = body.get("message") or exc.response.text[:300] or exc.response.reason_phrase
        status = exc.status_code
        if status == 401:
            return (f"rein rejected the API key (401: {message}). Pass a valid key with --api-key "
                    "or set REIN_API_KEY (create one with `rein keys create --scopes batch`).")
        if status == 403:
            return f"{message} (403): use a key created with the `batch` scope."
        return f"{_what(exc)} answered {status}: {message}"


def _what(exc: Any) -> str:
    """`METHOD /path` of the request an openai error is about."""
    request = getattr(exc, "request", None)
    return f"{request.method} {request.url.path}" if request is not None else "the request"


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
    submit.add_argument("--max-outage", type=float, default=DEFAULT_MAX_OUTAGE_SECONDS, metavar="S",
                        help="with --wait: keep polling through this many seconds in a row of rein being "
                             f"unreachable or answering 5xx (an API restart) before giving up (default "
                             f"{DEFAULT_MAX_OUTAGE_SECONDS:g})")
    submit.add_argument("--no-progress", action="store_true", help="no progress bar")
    submit.set_defaults(func=_guard(run_submit))

    status = actions.add_parser("status", parents=[common], help="show a batch")
    status.add_argument("batch_id", metavar="ID")
    status.add_argument("--json", action="store_true", help="print the batch object as JSON")
    status.set_defaults(func=_guard(run_status))

    listing = actions.add_parser("list", parents=[common], help="list your batches, newest first",
                                 description="List the key's tenant's batches, newest first, a page at a time.")
    listing.add_argument("--limit", type=int, default=None, metavar="N",
                         help="show at most N batches (default: all of them)")
    listing.add_argument("--json", action="store_true", help="print each batch object as a JSON line")
    listing.set_defaults(func=_guard(run_list))

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
    if args.max_outage < 0:
        raise BatchCLIError(f"--max-outage must be 0 or more seconds, got {args.max_outage:g}")
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
            batch = wait_for_batch(client, batch, args.poll_interval, progress=not args.no_progress,
                                   max_outage=args.max_outage)
        except KeyboardInterrupt:
            print(f"\nstopped waiting; the batch keeps running: `rein batch status {batch['id']}`",
                  file=sys.stderr)
            return 130
        return _finish(client, batch, output, errors)


def wait_for_batch(client: BatchClient, batch: dict[str, Any], poll_seconds: float,
                   progress: bool = True, max_outage: float = DEFAULT_MAX_OUTAGE_SECONDS) -> dict[str, Any]:
    """Polls the batch until it reaches a terminal status, showing request_counts on a bar;
    through an outage of up to `max_outage` seconds in a row (see the module docstring)."""
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
            batch = poll_through_outages(client, batch["id"], max_outage,
                                         lambda text: bar.write(text, file=sys.stderr))


def poll_through_outages(client: BatchClient, batch_id: str, max_outage: float,
                         say: Any = lambda text: print(text, file=sys.stderr)) -> dict[str, Any]:
    """The batch, asked again (backing off, saying so) while rein is unavailable, until
    `max_outage` seconds have passed since the first failure (then its Unavailable error)."""
    began = time.monotonic()
    pause = 1.0
    while True:
        try:
            return client.batch(batch_id)
        except Unavailable as exc:
            waited = time.monotonic() - began
            if waited + pause > max_outage:
                raise Unavailable(f"{exc} (still failing after {waited:.0f} s of waiting, --max-outage "
                                  f"{max_outage:g}; the batch keeps running: `rein batch status {batch_id}`)") \
                    from None
            say(f"rein is unavailable ({exc}); asking again in {pause:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, MAX_POLL_BACKOFF_SECONDS)


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


def run_list(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise BatchCLIError(f"--limit must be at least 1, got {args.limit}")
    page_size = min(args.limit or LIST_PAGE_SIZE, LIST_PAGE_SIZE)
    shown = 0
    with _client(args) as client:
        for batch in client.batches(page_size):
            if args.limit is not None and shown >= args.limit:
                break
            print(json.dumps(batch) if args.json else _one_line(batch), flush=True)
            shown += 1
    if not shown and not args.json:
        print("no batches", file=sys.stderr)
    return 0


def _one_line(batch: dict[str, Any]) -> str:
    counts = batch.get("request_counts") or {}
    created = _when(batch["created_at"]) if batch.get("created_at") else "?"
    return (f"{batch['id']}  {batch.get('status')}  {batch.get('endpoint', '')}  {created}  "
            f"{counts.get('completed', 0)}/{counts.get('total', 0)} completed, {counts.get('failed', 0)} failed")


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
