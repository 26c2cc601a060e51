"""Logging for every rein process: one setup function, JSON lines off a terminal, and job
context fields on every line about a job.

`configure_logging()` is called once by the `rein` command (rein.cli.main) before any
subcommand runs; `rein api` keeps uvicorn and `rein worker` keeps Celery from installing
their own handlers, so their lines come out in the same shape. Two shapes:

* JSON, one object per line, when stderr is not a terminal (a container, a log file,
  `rein up`'s pipes) or REIN_LOG_FORMAT=json:
  `{"ts": "...Z", "level": "INFO", "logger": "rein.worker.tasks", "msg": "...",
  "job_id": "...", "key_id": "...", "model": "...", "worker": "..."}`;
* readable text on a terminal or with REIN_LOG_FORMAT=text, the context fields at the end
  of the line as `[job_id=... key_id=...]`.

Context: code that works on a job wraps it in `with log_context(job_id=..., key_id=...,
model=..., worker=...)`; every line logged inside, by any logger in that thread or asyncio
task, carries those fields, so `grep <job id>` follows one job from the API through the
worker. A field passed with `extra=` on a single call wins over the context.

Never at INFO: a key's secret or prompt text. Messages log ids and counts only; as a net,
anything shaped like an API key (`rein_<key id>_<secret>`) has its secret replaced with
`<redacted>` in every line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, Literal, TextIO

LogFormat = Literal["auto", "json", "text"]

# The fields the issue promises on every line about a job, in the order lines show them.
JOB_FIELDS = ("job_id", "key_id", "model", "worker")

_context: ContextVar[Mapping[str, Any]] = ContextVar("rein_log_context", default=MappingProxyType({}))

# rein_<key id>_<secret> (rein.store.keys): keep the id, which names the key, drop the secret.
_KEY_SECRET = re.compile(r"\b(rein_[0-9a-f]{4,}_)[0-9A-Za-z]{8,}")
REDACTED = "<redacted>"


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add `fields` (None and "" skipped) to every line logged inside, in this thread or task."""
    merged = {**_context.get(), **{k: v for k, v in fields.items() if v is not None and v != ""}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


def current_context() -> dict[str, Any]:
    """The context fields in force here (a copy)."""
    return dict(_context.get())


def redact(text: str) -> str:
    """`text` with the secret of anything shaped like an API key replaced."""
    if "rein_" not in text:   # most lines: skip the regex (this runs on every line)
        return text
    return _KEY_SECRET.sub(rf"\1{REDACTED}", text)


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The context fields of a record: the context when it was logged, then `extra=` ids."""
    fields = dict(getattr(record, "rein_context", None) or {})
    for name in JOB_FIELDS:
        value = record.__dict__.get(name)
        if value is not None:
            fields[name] = value
    # The promised ids first, in a fixed order; anything else after them.
    ordered = {name: fields.pop(name) for name in JOB_FIELDS if name in fields}
    return ordered | fields


class ContextFilter(logging.Filter):
    """Stamps the emitting thread's/task's context on the record (it runs in that thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rein_context"):
            record.rein_context = _context.get()
        return True


_second: tuple[int, str] = (-1, "")


def _timestamp(record: logging.LogRecord) -> str:
    """`2026-11-29T20:55:01.123Z` (UTC). The part up to the second is formatted once a second:
    a busy API logs hundreds of lines in each."""
    global _second
    whole = int(record.created)
    if _second[0] != whole:
        _second = (whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)))
    return f"{_second[1]}.{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the context fields, exc when any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname,
                                 "logger": record.name, "msg": redact(record.getMessage())}
        entry.update(record_fields(record))
        if record.exc_info:
            entry["exc"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`2026-11-29 20:55:01,123 INFO rein.worker.tasks: msg [job_id=... model=...]`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = record_fields(record)
        if fields:
            tail = " ".join(f"{k}={v}" for k, v in fields.items())
            first, newline, rest = line.partition("\n")   # after the message, before a traceback
            line = f"{first} [{tail}]{newline}{rest}"
        return redact(line)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (tests swap it; a fixed stream may close)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:   # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def use_json(log_format: LogFormat, stream: TextIO) -> bool:
    """JSON unless asked for text, or left to auto with a terminal on the other end."""
    if log_format == "auto":
        isatty = getattr(stream, "isatty", None)
        return not (isatty is not None and isatty())
    return log_format == "json"


def configure_logging(level: int = logging.INFO, log_format: LogFormat = "auto",
                      stream: TextIO | None = None) -> logging.Handler:
    """Install rein's handler on the root logger (replacing one installed before); returns it.

    `stream` None: stderr as it is at each line. Handlers others installed (a test runner's
    capture) are left in place.
    """
    handler: logging.Handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if use_json(log_format, stream or sys.stderr) else TextFormatter())
    handler.addFilter(ContextFilter())
    handler.rein_handler = True   # type: ignore[attr-defined]
    # Neither shape shows the caller's file and line, the thread or the process: tell the
    # logging module not to look them up for every record (its documented optimization).
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "rein_handler", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def configured_elsewhere() -> bool:
    """True when the root logger has handlers rein did not install (a test runner's capture,
    a program embedding rein): then, like logging.basicConfig, the `rein` command leaves
    logging as it is found instead of adding its own handler to theirs."""
    return any(not getattr(h, "rein_handler", False) for h in logging.getLogger().handlers)


def remove_handler(handler: logging.Handler) -> None:
    """Take a handler from configure_logging off the root logger again (tests)."""
    logging.getLogger().removeHandler(handler)
