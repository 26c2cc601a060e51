"""What parsing a JSON text may cost, bounded before it is parsed: `parse_json_within_budget`.

`json.loads` builds a Python object for every value, and an object costs far more than the
text that names it: `[],` is 3 bytes and becomes a list of about 80 bytes. A 16 MiB body of
them cost the API 399 MiB and 4.4 s of CPU, before anything looked at what it held. So the
text's containers and values are counted first, on the bytes, and a text with more of either
than its caps is refused unparsed. Within the caps a parse costs at most a few tens of
megabytes more than the text (the figures are beside the caps).

Counting is two passes of `bytes.count`: commas bound the values from above, and `[` `{`
bound the containers. Only when those rough counts pass a cap are the strings taken out
(a comma or bracket inside a string is text, not structure) and the counts made again, so a
request whose text merely holds many commas is not refused. Nesting needs no count of its
own: json's parser stops at its recursion limit (a RecursionError, refused here as too
deep), and `rein.core.input_checks.check_json` refuses past MAX_JSON_DEPTH after the parse.

Used by the API for every JSON body (rein.api.checked_route) and by batch input lines.
Framework-free.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rein.core.input_checks import MAX_JSON_DEPTH, BadInput

# Far beyond what a real request holds: 1,024 messages with content parts and tools come to a
# few thousand containers; a completions prompt of token ids is one list of up to the
# context's length. At the caps, the objects come to at most ~16 MiB of containers (about
# 250 bytes for a small dict) and ~64 MiB of values (a short string, with its slot).
MAX_JSON_CONTAINERS = 65_536
MAX_JSON_VALUES = 1_048_576

# A JSON string as the parser reads one: quote, characters or escapes, quote. Unrolled so a
# long string is one scan, not a backtracking loop.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TEXT_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def json_shape_counts(raw: bytes | str) -> tuple[int, int]:
    """(containers, values) of a JSON text, as upper bounds: exact for valid JSON's containers,
    and values counted as separators + containers + 1."""
    containers, values = _rough_counts(raw)
    if containers > MAX_JSON_CONTAINERS or values > MAX_JSON_VALUES:
        # A string is one value; its text is not structure.
        structure = _STRING.sub(b"0", raw) if isinstance(raw, bytes) else _TEXT_STRING.sub("0", raw)
        containers, values = _rough_counts(structure)
    return containers, values


def _rough_counts(raw: bytes | str) -> tuple[int, int]:
    if isinstance(raw, bytes):
        containers = raw.count(b"[") + raw.count(b"{")
        return containers, raw.count(b",") + containers + 1
    containers = raw.count("[") + raw.count("{")
    return containers, raw.count(",") + containers + 1


def check_json_budget(raw: bytes | str, what: str = "The request body") -> None:
    """BadInput when parsing `raw` would build more containers or values than the caps allow."""
    containers, values = json_shape_counts(raw)
    if containers > MAX_JSON_CONTAINERS:
        raise BadInput(f"{what} holds {containers:,} JSON arrays and objects, more than the "
                       f"{MAX_JSON_CONTAINERS:,} rein parses in one request; send fewer, or split the work "
                       f"over several requests (or a batch file)")
    if values > MAX_JSON_VALUES:
        raise BadInput(f"{what} holds about {values:,} JSON values, more than the {MAX_JSON_VALUES:,} rein "
                       f"parses in one request; send fewer, or split the work over several requests (or a "
                       f"batch file)")


def parse_json_within_budget(raw: bytes | str, what: str = "The request body") -> Any:
    """`json.loads(raw)` after `check_json_budget`. BadInput when over the caps or nested past
    json's recursion limit; json.JSONDecodeError / UnicodeDecodeError when it is not JSON."""
    check_json_budget(raw, what)
    try:
        return json.loads(raw)
    except RecursionError:
        raise BadInput(f"{what} is JSON nested deeper than {MAX_JSON_DEPTH} levels; flatten it") from None
