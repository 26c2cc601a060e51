"""Tool calls read out of generated text: the machine every auto-mode format shares
(`AnswerParser`), Hermes-style `<tool_call>` blocks of an auto answer, whole or streamed
(`HermesParser`), and the JSON array of a "required" answer; each call gets an id derived from
the response (`call_id`). The other formats (`--tool-call-parser`) are in
rein.openai.tool_call_parsers; rein.openai.tools turns calls into bodies and chunks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def call_id(seed: str, index: int) -> str:
    """OpenAI's `call_...` id, derived from the response (rein.openai.tools says why)."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def tool_call(seed: str, index: int, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id(seed, index), "type": "function", "function": {"name": name, "arguments": arguments}}


def _arguments_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def parse_call_block(body: str, names: frozenset[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one Hermes block's JSON; None if it is not a call of a known tool."""
    # Any failure means "not a call" (the block stays content): a model's output nested deeper
    # than Python's recursion limit raises RecursionError, not a JSON error.
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return call_of(obj, names)


def call_of(obj: Any, names: frozenset[str], keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded `{"name": ..., <key>: {...}}` object, the arguments
    under the first of `keys` present (none: no arguments); None if it is not a call of a known tool."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = next((obj[key] for key in keys if key in obj), {})
    if isinstance(arguments, str):    # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        return obj["name"], _arguments_json(arguments)
    except RecursionError:
        return None


class JsonEnd:
    """Finds where a JSON object or array ends in text that arrives in pieces: brackets are
    counted outside strings (json.loads then checks the whole). Start it on the opening `{`/`[`."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int:
        """The index just past the value's closing bracket in `text` (this piece), or -1 if it
        has not closed yet."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return -1


class AnswerParser:
    """What every auto-mode parser shares: the calls found so far and the content around them.

    A parser is one incremental machine for whole answers and streams (`feed` the text as it
    comes, then `finish`), so the streamed content concatenates to the non-streamed one.
    Whitespace is held back until text follows it: whitespace around parsed calls, before the
    first text or at the end of an answer with calls is dropped. `parameters` maps each tool's
    name to its parameters schema (the formats that write values untyped convert by it).
    """

    def __init__(self, names: frozenset[str], seed: str,
                 parameters: Mapping[str, dict[str, Any]] | None = None) -> None:
        self.names = names
        self.seed = seed
        self.parameters = parameters or {}
        self.calls: list[dict[str, Any]] = []
        self._held = ""            # trailing whitespace of the content so far
        self._after_call = False
        self._emitted = False      # any content yet

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for `text`: {"content": str} or {"tool_calls": [{index, id, type, function}]}."""
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the answer releases."""
        raise NotImplementedError

    def _release_held(self, out: list[dict[str, Any]]) -> None:
        """At the end: held-back whitespace is content only when the answer holds no call."""
        if self._held and not self.calls:     # no calls: the answer comes back exactly as written
            out.append({"content": self._held})
        self._held = ""

    def _content(self, text: str, out: list[dict[str, Any]]) -> None:
        if self._after_call:
            # Whitespace after a call: dropped before any content, else held like any other
            # (it separates the text before the call from the text after it).
            rest = text.lstrip()
            if self._emitted:
                self._held += text[:len(text) - len(rest)]
            text = rest
            if not text:
                return
            self._after_call = False
        text = self._held + text
        kept = text.rstrip()
        self._held = text[len(kept):]
        if kept:
            self._emitted = True
            out.append({"content": kept})

    def _call(self, name: str, arguments: str, out: list[dict[str, Any]]) -> None:
        index = len(self.calls)
        call = tool_call(self.seed, index, name, arguments)
        self.calls.append(call)
        self._held = ""
        self._after_call = True
        out.append({"tool_calls": [{"index": index, **call}]})


class HermesParser(AnswerParser):
    """Hermes-style blocks (`hermes`): text is content until `<tool_call>` (a partial tag at the
    end of the text so far is held back), a block is held until `</tool_call>` and then becomes
    a call or, when malformed, content. Subclasses change how a block's body is read
    (`parse_block`): rein.openai.tool_parser_qwen3_coder."""

    start_tag = TOOL_CALL_START
    end_tag = TOOL_CALL_END

    def __init__(self, names: frozenset[str], seed: str,
                 parameters: Mapping[str, dict[str, Any]] | None = None) -> None:
        super().__init__(names, seed, parameters)
        self._buffer = ""
        self._in_block = False

    def parse_block(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of one block's body; None if it is not a call of a known tool."""
        return parse_call_block(body, self.names)

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buffer += text
        while True:
            if not self._in_block:
                start = self._buffer.find(self.start_tag)
                if start < 0:
                    keep = _partial_tag(self._buffer, self.start_tag)
                    cut = len(self._buffer) - keep
                    self._content(self._buffer[:cut], out)
                    self._buffer = self._buffer[cut:]
                    return out
                self._content(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(self.start_tag):]
                self._in_block = True
            else:
                end = self._buffer.find(self.end_tag)
                if end < 0:
                    return out
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(self.end_tag):]
                self._in_block = False
                self._close(body, self.start_tag + body + self.end_tag, out)

    def finish(self) -> list[dict[str, Any]]:
        """An unclosed last block (a call when its JSON is complete: the answer may stop at
        `</tool_call>` or EOS), held-back text."""
        out: list[dict[str, Any]] = []
        if self._in_block:
            self._in_block = False
            self._close(self._buffer, self.start_tag + self._buffer, out)
        else:
            self._content(self._buffer, out)
        self._buffer = ""
        self._release_held(out)
        return out

    def _close(self, body: str, raw: str, out: list[dict[str, Any]]) -> None:
        parsed = self.parse_block(body)
        if parsed is None:
            self._content(raw, out)
        else:
            self._call(*parsed, out)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (a tag still arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_hermes(text: str, names: frozenset[str], seed: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole auto-mode answer in the Hermes format (`parse_whole`)."""
    return parse_whole(HermesParser(names, seed), text)


def parse_whole(parser: AnswerParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole auto-mode answer through a fresh `parser`; the content is
    the text unchanged when it holds no call, else the text outside the calls (None if nothing
    is left)."""
    deltas = parser.feed(text) + parser.finish()
    if not parser.calls:
        return text, []
    content = "".join(d["content"] for d in deltas if "content" in d)
    return content or None, parser.calls


def parse_required(text: str, names: frozenset[str], seed: str) -> list[dict[str, Any]]:
    """The calls of a "required" answer (a JSON array of {name, parameters}); an answer cut
    short yields the elements it completed."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    i = _skip_space(text, 0)
    if text[i:i + 1] == "[":
        i += 1
        while True:
            i = _skip_space(text, i)
            if i >= len(text) or text[i] == "]":
                break
            try:
                item, i = decoder.raw_decode(text, i)
            except (ValueError, RecursionError):   # RecursionError: output nested past Python's limit
                break
            items.append(item)
            i = _skip_space(text, i)
            if text[i:i + 1] != ",":
                break
            i += 1
    calls = []
    for item in items:
        if isinstance(item, dict) and item.get("name") in names and isinstance(item.get("parameters"), dict):
            try:
                arguments = _arguments_json(item["parameters"])
            except RecursionError:
                break
            calls.append(tool_call(seed, len(calls), item["name"], arguments))
    return calls


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i

