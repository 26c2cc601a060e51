"""rein.core.logging: the JSON and text formats, job context fields, redaction of key
secrets, the handler setup, and a scan of rein's log calls for prompt text and secrets."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rein.core.logging import (
    JOB_FIELDS,
    REDACTED,
    configure_logging,
    configured_elsewhere,
    current_context,
    log_context,
    redact,
    remove_handler,
    use_json,
)

KEY = "rein_0123456789ab_" + "S3cr3t" * 7 + "x"    # the shape rein.store.keys.format_key makes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """Each test leaves the root logger's handlers and level as it found them."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def capture() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    """rein's JSON handler on a buffer, and a logger that writes through it."""
    buffer = io.StringIO()
    handler = configure_logging(logging.DEBUG, "json", buffer)
    try:
        yield buffer, logging.getLogger("rein.test")
    finally:
        remove_handler(handler)


def lines(buffer: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_json_line_has_the_base_fields_and_the_job_context_in_order(capture):
    buffer, log = capture
    with log_context(worker="w@host", model="tiny"), log_context(job_id="job_1", key_id="abc", attempt=2):
        log.info("job %s started", "job_1")
    log.warning("outside")
    inside, outside = lines(buffer)
    assert list(inside)[:4] == ["ts", "level", "logger", "msg"]
    assert inside["ts"].endswith("Z") and inside["level"] == "INFO" and inside["logger"] == "rein.test"
    assert inside["msg"] == "job job_1 started"
    assert [k for k in inside if k in JOB_FIELDS] == list(JOB_FIELDS)     # fixed order
    assert (inside["job_id"], inside["key_id"], inside["model"], inside["worker"], inside["attempt"]) == \
        ("job_1", "abc", "tiny", "w@host", 2)
    assert not set(JOB_FIELDS) & set(outside)                             # the context was reset


def test_context_skips_empty_values_and_extra_wins(capture):
    buffer, log = capture
    with log_context(job_id="j", key_id="", model=None):
        assert current_context() == {"job_id": "j"}
        log.info("x", extra={"job_id": "override", "worker": "w"})
    [line] = lines(buffer)
    assert line["job_id"] == "override" and line["worker"] == "w"
    assert "key_id" not in line and "model" not in line


def test_threads_and_tasks_keep_their_own_context(capture):
    buffer, log = capture

    def job(n: int) -> None:
        with log_context(job_id=f"thread-{n}"):
            barrier.wait()          # both contexts are set at once
            log.info("in thread %d", n)

    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=job, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    async def task(n: int) -> None:
        with log_context(job_id=f"task-{n}"):
            await asyncio.sleep(0.01)
            log.info("in task %d", n)

    async def both() -> None:
        await asyncio.gather(task(0), task(1))

    asyncio.run(both())
    seen = {line["msg"]: line["job_id"] for line in lines(buffer) if line["logger"] == "rein.test"}
    assert seen == {"in thread 0": "thread-0", "in thread 1": "thread-1",
                    "in task 0": "task-0", "in task 1": "task-1"}


def test_timestamp_is_the_records_utc_time_to_the_millisecond():
    from datetime import UTC, datetime

    from rein.core.logging import JsonFormatter

    formatter = JsonFormatter()
    # Two records in one second (the formatted second is reused), then one in the next.
    for created in (1764460801.123456, 1764460801.999, 1764460802.0005):
        record = logging.LogRecord("rein.test", logging.INFO, __file__, 1, "m", None, None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        expected = datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert json.loads(formatter.format(record))["ts"] == expected


def test_key_secrets_are_redacted_in_messages_and_tracebacks(capture):
    buffer, log = capture
    secret = KEY.split("_")[2]
    log.info("header was Bearer %s", KEY)
    try:
        raise ValueError(f"bad key {KEY}")
    except ValueError:
        log.exception("auth failed")
    text = buffer.getvalue()
    assert secret not in text
    assert text.count(f"rein_0123456789ab_{REDACTED}") == 2     # the key id stays: it names the key
    assert redact("no key here, rein_ alone") == "no key here, rein_ alone"


def test_text_format_puts_the_context_after_the_message():
    buffer = _Terminal()
    handler = configure_logging(logging.INFO, "auto", buffer)
    try:
        with log_context(job_id="j9", model="tiny"):
            logging.getLogger("rein.test").info("hello")
            try:
                raise RuntimeError("boom")
            except RuntimeError:
                logging.getLogger("rein.test").exception("failed")
    finally:
        remove_handler(handler)
    first, *rest = buffer.getvalue().splitlines()
    assert first.endswith(" INFO rein.test: hello [job_id=j9 model=tiny]")
    assert rest[0].endswith("failed [job_id=j9 model=tiny]") and rest[-1] == "RuntimeError: boom"


def test_format_choice():
    assert use_json("auto", io.StringIO()) is True        # a file or a pipe: JSON
    assert use_json("auto", _Terminal()) is False         # a terminal: text
    assert use_json("json", _Terminal()) is True
    assert use_json("text", io.StringIO()) is False


def test_configure_replaces_its_own_handler_and_keeps_others():
    root = logging.getLogger()
    other = logging.NullHandler()
    root.addHandler(other)
    first = configure_logging(logging.INFO, "json", io.StringIO())
    second = configure_logging(logging.DEBUG, "json", io.StringIO())
    try:
        assert first not in root.handlers and second in root.handlers and other in root.handlers
        assert root.level == logging.DEBUG
    finally:
        remove_handler(second)
        root.removeHandler(other)


def test_the_rein_command_leaves_a_foreign_setup_alone():
    root = logging.getLogger()
    root.handlers[:] = []
    assert not configured_elsewhere()                 # a fresh process: `rein` installs its own
    configure_logging(logging.INFO, "json", io.StringIO())
    assert not configured_elsewhere()                 # its own handler does not count
    root.addHandler(logging.NullHandler())            # a test runner's capture, an embedding program
    assert configured_elsewhere()


def test_stderr_handler_follows_sys_stderr(capsys):
    handler = configure_logging(logging.INFO, "json")
    try:
        logging.getLogger("rein.test").info("to stderr")
    finally:
        remove_handler(handler)
    assert json.loads(capsys.readouterr().err.splitlines()[-1])["msg"] == "to stderr"


# -- no prompt text or secrets in rein's log calls ----------------------------------------------

LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
# Values that hold prompt or completion text, request bodies or key material.
FORBIDDEN = {"body", "payload", "prompt", "prompt_token_ids", "messages", "content", "text", "secret",
             "authorization", "api_key", "raw_key", "token_ids", "params", "sampling"}


def _forbidden_names(node: ast.AST) -> Iterator[str]:
    """Names in an argument expression, except inside len(...) (a count is fine)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "len":
        return
    if isinstance(node, ast.Name) and node.id in FORBIDDEN:
        yield node.id
    if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN:
        yield node.attr
    for child in ast.iter_child_nodes(node):
        yield from _forbidden_names(child)


def offending_log_calls(source: str, filename: str = "<snippet>") -> list[str]:
    """`file:line logs 'name'` for each log call whose arguments use a FORBIDDEN value."""
    offenders = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LOG_METHODS and isinstance(node.func.value, ast.Name)
                and node.func.value.id in ("log", "logger", "logging")):
            continue
        values = [*node.args[1:], *(k.value for k in node.keywords)]
        for name in sorted({n for value in values for n in _forbidden_names(value)}):
            offenders.append(f"{filename}:{node.lineno} logs {name!r}")
    return offenders


def test_no_log_call_in_rein_formats_prompt_text_or_secrets():
    root = Path(__file__).resolve().parents[2]
    offenders = [o for path in sorted((root / "rein").rglob("*.py"))
                 for o in offending_log_calls(path.read_text(), str(path.relative_to(root)))]
    assert offenders == []


def test_the_scan_catches_an_offending_call():
    # The check above must be able to fail: a prompt is caught, a count of messages is not.
    source = 'log.info("prompt %s by %s", body["prompt"], len(messages))\nlog.debug("%s", key.secret)'
    assert offending_log_calls(source) == ["<snippet>:1 logs 'body'", "<snippet>:2 logs 'secret'"]
