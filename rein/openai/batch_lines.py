"""Lines of OpenAI Batch files: one request per input line, one result or error per output line.

Input lines are read under a length cap (`read_lines`): unbounded, json.loads of a 200 MB
one-line file of `[],` would need some 5 GiB. A line longer than the cap is
skipped to its newline, never held whole nor parsed, and comes out as an `OversizedLine`, which
its reader answers as that line's error (`OversizedLine.message`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from rein.core.input_checks import BadInput, check_json, json_type, text_problem
from rein.core.json_budget import parse_json_within_budget
from rein.openai.endpoints import BATCH_ENDPOINTS
from rein.openai.errors import (
    RequestError,
)

# Lines are read this much at a time; a longer one is measured before it is read whole.
LINE_CHUNK_BYTES = 1 << 16


@dataclass(frozen=True)
class OversizedLine:
    """A line longer than the cap: skipped, so only its size is known."""

    size: int
    """The line's bytes, its newline not counted."""
    limit: int
    """The cap it passed (REIN_MAX_REQUEST_BYTES)."""

    def message(self, line_number: int) -> str:
        """The line's error: its number, its size, the limit, what to do."""
        return (f"line {line_number}: the line is {self.size} bytes, over the limit of {self.limit} bytes per "
                f"request line (REIN_MAX_REQUEST_BYTES, as for a request to the API), so it was not read. "
                f"Make the request smaller (a shorter prompt or fewer messages), or ask the operator to "
                f"raise REIN_MAX_REQUEST_BYTES")


def read_lines(source: IO[bytes], max_line_bytes: int) -> Iterator[bytes | OversizedLine]:
    """The lines of a binary file, each with its newline (the last may have none), as iterating
    the file gives them, except that a line longer than `max_line_bytes` (its newline not
    counted) comes as an OversizedLine. The file is read LINE_CHUNK_BYTES at a time: a line
    longer than that is first measured chunk by chunk without being kept, then, when within the
    cap, read again whole (a file that cannot seek keeps its chunks until they pass the cap). So
    an oversized line costs a chunk of memory, whatever its length, and any other line its own
    bytes."""
    seekable = source.seekable()
    while piece := source.readline(LINE_CHUNK_BYTES):
        if piece[-1:] == b"\n" or len(piece) < LINE_CHUNK_BYTES:      # the whole line (or the file's last)
            size = len(piece) - (piece[-1:] == b"\n")
            yield piece if size <= max_line_bytes else OversizedLine(size, max_line_bytes)
            continue
        start = source.tell() - len(piece) if seekable else 0
        pieces: list[bytes] | None = None if seekable else [piece]
        size = len(piece)
        del piece
        while rest := source.readline(LINE_CHUNK_BYTES):
            ended = rest[-1:] == b"\n"
            size += len(rest) - ended
            if pieces is not None:
                if size <= max_line_bytes:
                    pieces.append(rest)
                else:
                    pieces.clear()      # past the cap: nothing of it is kept
            if ended:
                break
        if size > max_line_bytes:
            yield OversizedLine(size, max_line_bytes)
        elif pieces is not None:
            yield b"".join(pieces)
        else:
            end = source.tell()
            source.seek(start)
            yield source.read(end - start)


@dataclass
class BatchLine:
    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


def parse_batch_line(line: str, line_number: int) -> BatchLine:
    """One line of an OpenAI batch input file; errors name the line and what is wrong."""
    problem = text_problem(line)   # a raw NUL byte: JSON's own error would only say "control character"
    if problem is not None:
        raise RequestError(f"line {line_number}: the line {problem}", None, "invalid_json_line")
    try:
        # Bounded like an API body (rein.core.json_budget): a line within the length cap can
        # still hold millions of empty arrays, each far larger parsed than written.
        obj = parse_json_within_budget(line, "The line")
    except BadInput as exc:
        raise RequestError(f"line {line_number}: {exc.message}", None, "invalid_json_line") from None
    except json.JSONDecodeError as exc:
        raise RequestError(f"line {line_number}: not valid JSON ({exc.msg} at column {exc.colno})", None,
                           "invalid_json_line") from exc
    if not isinstance(obj, dict):
        raise RequestError(f"line {line_number}: must be a JSON object, got {json_type(obj)}")
    try:
        check_json(obj)   # text Postgres and the tokenizer can take, numbers that fit (rein.core.input_checks)
    except BadInput as exc:
        raise RequestError(f"line {line_number}: {exc.message}", exc.param, "invalid_value") from None
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestError(f"line {line_number}: custom_id is missing or not a non-empty string", "custom_id")
    method = obj.get("method")
    if method != "POST":
        raise RequestError(f"line {line_number}: method must be \"POST\", got {method!r}", "method")
    url = obj.get("url")
    if url not in BATCH_ENDPOINTS:
        raise RequestError(f"line {line_number}: url must be {', '.join(BATCH_ENDPOINTS)}, got {url!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RequestError(f"line {line_number}: body must be a JSON object, got {json_type(body)}", "body")
    return BatchLine(custom_id, method, url, body)


def custom_id_of(line: str) -> str | None:
    """The custom_id of a line that failed to parse, when it can still be read."""
    try:
        obj = parse_json_within_budget(line)
    except (json.JSONDecodeError, BadInput):
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    # One that cannot be written back (a NUL, a lone surrogate) is as good as missing.
    return custom_id if isinstance(custom_id, str) and text_problem(custom_id) is None else None


def batch_output_line(custom_id: str, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}


def batch_error_line(custom_id: str | None, line_number: int, code: str, message: str) -> dict[str, Any]:
    if not message.startswith(f"line {line_number}:"):
        message = f"line {line_number}: {message}"
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}
