"""Input that no part of rein can store or process, refused before anything reads it.

Some values are valid JSON (or a valid URL) yet break what they reach: Postgres refuses
U+0000 in `text` and `jsonb`; a lone UTF-16 surrogate (JSON's `"\\ud800"` without its
pair) cannot be encoded as UTF-8, so the tokenizer, Postgres and the JSON response all
fail on it; JSON numbers that Python reads as infinity (`1e400`) or as integers past
64 bits fit no column and no engine parameter. Rather than guard each place one of them
could land, every request is checked once, up front: the API's route class
(rein.api.checked_route) checks every JSON body, query, path and header parameter, and
rein.openai.request checks every batch input line. Framework-free, so the offline batch
runner uses the same rules.

A check raises `BadInput`, whose `param` is the JSON path of the bad value
(`messages[0].content`, `metadata.<key>`) and whose message says what was wrong and what
to send instead. Messages never repeat the bad text itself (it could not be stored).
"""

from __future__ import annotations

import math
import re
from typing import Any

# Signed 64-bit: Postgres bigint, and the widest integer the engine takes (a seed).
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# No request rein understands nests deeper than a few levels; a limit keeps a hostile body
# from exhausting the stack of whatever walks it next (pydantic, Postgres' jsonb parser).
MAX_JSON_DEPTH = 64

_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")


class BadInput(ValueError):
    """A value rein cannot take; `param` names where it is (a JSON path or a parameter)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def json_type(value: Any) -> str:
    """How an error message names a JSON value's type: "a string", "a number", "null", ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def text_problem(text: str) -> str | None:
    """Why `text` cannot be taken (a NUL character or a lone surrogate, and where), or None."""
    if "\x00" not in text:
        if text.isascii():
            return None
        try:    # no surrogate can be encoded; this is much faster than the regex below
            text.encode("utf-8")
            return None
        except UnicodeEncodeError:
            pass
    match = _BAD_CHAR.search(text)
    if match is None:
        return None
    char = match.group()
    if char == "\x00":
        return (f"contains a NUL character (U+0000) at index {match.start()}, which rein cannot store; "
                "remove it")
    return (f"contains a lone UTF-16 surrogate (U+{ord(char):04X}) at index {match.start()}, which is not "
            "valid Unicode; send each character outside the BMP as a surrogate pair (e.g. \\ud83d\\ude00) "
            "or as UTF-8")


def check_text(text: str, param: str | None) -> None:
    """BadInput naming `param` when `text` holds a NUL character or a lone surrogate."""
    problem = text_problem(text)
    if problem is not None:
        raise BadInput(f"{param}: {problem}" if param else f"the value {problem}", param)


def check_json(value: Any, root: str | None = None) -> None:
    """Walk a parsed JSON value (keys and values); BadInput at the first value rein cannot take,
    in document order.

    Refused: strings (object keys too) with a NUL character or a lone surrogate, numbers
    that are not finite (`NaN`, `Infinity`, or `1e400`, which parses as infinity), integers
    outside the signed 64-bit range, and nesting deeper than MAX_JSON_DEPTH. `root` prefixes
    the paths in errors (e.g. "body" for the request inside a job).
    """
    if isinstance(value, (dict, list)):
        _walk(value, root, 0)
    else:
        _check_scalar(value, root)


def _walk(container: dict[str, Any] | list[Any], path: str | None, depth: int) -> None:
    # Recursion stops at MAX_JSON_DEPTH, far below Python's limit. A path is built only for
    # nested containers and errors: a list of 10,000 token ids costs one comparison each.
    if depth >= MAX_JSON_DEPTH:
        raise BadInput(f"{_name(path)}: JSON nested deeper than {MAX_JSON_DEPTH} levels; flatten it", path)
    if isinstance(container, dict):
        for key, child in container.items():
            if not key.isascii() or "\x00" in key:
                problem = text_problem(key)
                if problem is not None:
                    raise BadInput(f"{_name(path)}: an object key {problem}", path)
            if child.__class__ is int:
                if INT64_MIN <= child <= INT64_MAX:
                    continue
            elif child.__class__ is str:
                if child.isascii() and "\x00" not in child:
                    continue
            elif child is None or child.__class__ is bool:
                continue
            child_path = f"{path}.{key}" if path else key
            if isinstance(child, (dict, list)):
                _walk(child, child_path, depth + 1)
            else:
                _check_scalar(child, child_path)
    else:
        for index, child in enumerate(container):
            if child.__class__ is int:
                if INT64_MIN <= child <= INT64_MAX:
                    continue
            elif child.__class__ is str:
                if child.isascii() and "\x00" not in child:
                    continue
            elif child is None or child.__class__ is bool:
                continue
            child_path = f"{path or ''}[{index}]"
            if isinstance(child, (dict, list)):
                _walk(child, child_path, depth + 1)
            else:
                _check_scalar(child, child_path)


def _check_scalar(item: Any, path: str | None) -> None:
    if isinstance(item, str):
        check_text(item, path)
    elif isinstance(item, bool) or item is None:
        return
    elif isinstance(item, int):
        if not INT64_MIN <= item <= INT64_MAX:
            raise BadInput(f"{_name(path)}: {_abbreviated(item)} is outside the 64-bit integer range "
                           f"[{INT64_MIN}, {INT64_MAX}]; send a smaller number", path)
    elif isinstance(item, float):
        if not math.isfinite(item):
            raise BadInput(f"{_name(path)}: the number is not finite ({item}; a literal past "
                           "±1.8e308 reads as infinity); send a finite number", path)


def _name(path: str | None) -> str:
    return path or "the request body"


def _abbreviated(number: int) -> str:
    digits = str(abs(number)) if number.bit_length() < 4000 else None
    if digits is None or len(digits) > 30:
        return f"a {number.bit_length()}-bit integer"
    return str(number)
