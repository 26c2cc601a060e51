"""Tool calls written as bare JSON, whole or streamed: Llama 3.x's (`llama3_json`) and Mistral's
(`mistral`), vLLM's parsers of those names. The machine they share with Hermes (content and
whitespace, call ids) is rein.openai.tool_parsers.AnswerParser; rein.openai.tool_call_parsers
picks one by name.

* ``llama3_json``: an answer that starts (after whitespace) with ``<|python_tag|>`` or ``{`` is
  a sequence of ``{"name": ..., "parameters": {...}}`` objects (``arguments`` taken too),
  separated by ``;``; any other answer is content. Each object becomes a call when it closes;
  one that does not parse or names an unknown function, and everything after it, is content.
* ``mistral``: text is content until ``[TOOL_CALLS]``; what follows is either a JSON array of
  ``{"name": ..., "arguments": {...}}`` objects (the older tokenizers; the array is one block:
  every element must be a call of a known tool, or the whole block stays content), or the
  newer ``name[ARGS]{...}`` (``[CALL_ID]id`` after the name is allowed and dropped), one call
  per ``[TOOL_CALLS]``. Text after a call is content again.

The markers are special tokens: ``<|python_tag|>`` is usually skipped in the decoded text,
which is why a bare ``{`` starts calls too; the mistral parser needs ``[TOOL_CALLS]`` in the
text, so rein keeps special tokens in the answer of its auto tool requests
(rein.openai.tool_request.ToolRequest.keeps_special_tokens), as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rein.openai.tool_parsers import AnswerParser, JsonEnd, _partial_tag, call_of

PYTHON_TAG = "<|python_tag|>"
TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_MAX_NAME_CHARS = 64 + 200     # OpenAI's longest name, and room for a [CALL_ID]: longer is not a call


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class Llama3JsonParser(AnswerParser):
    """`llama3_json` (see the module docstring)."""

    def __init__(self, names: frozenset[str], seed: str,
                 parameters: Mapping[str, dict[str, Any]] | None = None) -> None:
        super().__init__(names, seed, parameters)
        self._buffer = ""
        self._mode = "start"      # start | between (calls) | object | content
        self._raw = ""            # what precedes the open object, content if it fails
        self._end: JsonEnd | None = None
        self._scanned = 0         # of the open object's text in _buffer

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buffer += text
        while self._step(out):
            pass
        return out

    def _step(self, out: list[dict[str, Any]]) -> bool:
        """Advance once; False when more text is needed."""
        buffer = self._buffer
        if self._mode == "content":
            self._content(buffer, out)
            self._buffer = ""
            return False
        if self._mode == "start":
            rest = buffer.lstrip()
            if not rest:
                return False
            space = buffer[:len(buffer) - len(rest)]
            if rest.startswith(PYTHON_TAG):
                self._raw, self._buffer, self._mode = space + PYTHON_TAG, rest[len(PYTHON_TAG):], "between"
            elif rest.startswith("{"):
                self._raw, self._buffer, self._mode = space, rest, "between"
            elif len(rest) < len(PYTHON_TAG) and PYTHON_TAG.startswith(rest):
                return False      # the tag may still be arriving
            else:
                self._mode = "content"
            return True
        if self._mode == "between":
            rest = buffer.lstrip()
            if self.calls and rest.startswith(";"):    # the separator of Llama's calls
                rest = rest[1:].lstrip()
            if not rest:
                return False
            if rest.startswith("{"):
                if not self.calls:    # the tag and space before a first object: content if it fails
                    self._raw += buffer[:len(buffer) - len(rest)]
                self._buffer, self._mode, self._end, self._scanned = rest, "object", JsonEnd(), 0
                return True
            self._content(self._raw + buffer, out)
            self._raw, self._buffer, self._mode = "", "", "content"
            return False
        # object
        assert self._end is not None
        end = self._end.scan(buffer[self._scanned:])
        if end < 0:
            self._scanned = len(buffer)
            return False
        end += self._scanned
        raw, self._buffer = buffer[:end], buffer[end:]
        parsed = call_of(_loads(raw), self.names, ("parameters", "arguments"))
        if parsed is None:
            self._content(self._raw + raw, out)
            self._raw, self._mode = "", "content"
        else:
            self._call(*parsed, out)
            self._raw, self._mode = "", "between"
        return True

    def finish(self) -> list[dict[str, Any]]:
        """An unclosed object, a partial tag or a dangling separator: content (a dangling `;`
        after calls is dropped)."""
        out: list[dict[str, Any]] = []
        rest = self._buffer
        if self._mode == "between" and self.calls and rest.strip() == ";":
            rest = ""
        self._content(self._raw + rest, out)
        self._raw = self._buffer = ""
        self._release_held(out)
        return out


class MistralParser(AnswerParser):
    """`mistral` (see the module docstring)."""

    def __init__(self, names: frozenset[str], seed: str,
                 parameters: Mapping[str, dict[str, Any]] | None = None) -> None:
        super().__init__(names, seed, parameters)
        self._buffer = ""
        self._mode = "content"    # content | after_tag | array | name | args | object
        self._raw = ""            # the block so far (from [TOOL_CALLS]), content if it fails
        self._name = ""
        self._end: JsonEnd | None = None
        self._scanned = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._buffer += text
        while self._step(out):
            pass
        return out

    def _fail(self, out: list[dict[str, Any]]) -> None:
        """The block is not a call: its text is content, and so is what follows until the next tag."""
        self._content(self._raw, out)
        self._raw, self._mode = "", "content"

    def _step(self, out: list[dict[str, Any]]) -> bool:
        buffer = self._buffer
        if self._mode == "content":
            start = buffer.find(TOOL_CALLS)
            if start < 0:
                cut = len(buffer) - _partial_tag(buffer, TOOL_CALLS)
                self._content(buffer[:cut], out)
                self._buffer = buffer[cut:]
                return False
            self._content(buffer[:start], out)
            self._raw, self._buffer, self._mode = TOOL_CALLS, buffer[start + len(TOOL_CALLS):], "after_tag"
            return True
        if self._mode == "after_tag":
            rest = buffer.lstrip()
            if not rest:
                return False
            self._raw += buffer[:len(buffer) - len(rest)]
            self._buffer = rest
            self._mode, self._end, self._scanned = ("array", JsonEnd(), 0) if rest.startswith("[") else ("name", None, 0)
            return True
        if self._mode == "name":
            at = buffer.find(ARGS)
            if at < 0:
                if len(buffer) > _MAX_NAME_CHARS:
                    self._raw += buffer
                    self._buffer = ""
                    self._fail(out)
                    return True
                return False
            self._name = buffer[:at].split(CALL_ID, 1)[0].strip()
            self._raw += buffer[:at + len(ARGS)]
            self._buffer, self._mode = buffer[at + len(ARGS):], "args"
            return True
        if self._mode == "args":
            rest = buffer.lstrip()
            if not rest:
                return False
            self._raw += buffer[:len(buffer) - len(rest)]
            self._buffer = rest
            if not rest.startswith("{"):
                self._fail(out)
                return True
            self._mode, self._end, self._scanned = "object", JsonEnd(), 0
            return True
        # array or object: wait for its closing bracket
        assert self._end is not None
        end = self._end.scan(buffer[self._scanned:])
        if end < 0:
            self._scanned = len(buffer)
            return False
        end += self._scanned
        raw, self._buffer = buffer[:end], buffer[end:]
        self._raw += raw
        if self._mode == "array":
            items = _loads(raw)
            parsed = [call_of(item, self.names) for item in items] if isinstance(items, list) and items else [None]
        else:
            parsed = [call_of({"name": self._name, "arguments": _loads(raw)}, self.names)]
        if any(p is None for p in parsed):
            self._fail(out)
            return True
        for call in parsed:
            assert call is not None
            self._call(*call, out)
        self._raw, self._mode = "", "content"
        return True

    def finish(self) -> list[dict[str, Any]]:
        """An unfinished block is content, as is a partial tag."""
        out: list[dict[str, Any]] = []
        self._content(self._raw + self._buffer, out)
        self._raw = self._buffer = ""
        self._release_held(out)
        return out
