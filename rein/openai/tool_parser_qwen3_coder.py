"""Qwen3-Coder's XML tool calls (`qwen3_coder`, vLLM's parser of that name), whole or streamed:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The blocks are found as Hermes blocks are (rein.openai.tool_parsers.HermesParser: content
around them, a malformed block or an unknown function stays content); only the body is read
differently. A parameter's value is the text between its tags, less one newline on each side,
converted by the type its tool's JSON schema gives it: integer, number, boolean, object and
array values are parsed (``null`` is None), a value that does not convert stays a string, and
so does a parameter of type string, one without a type or one the schema does not list.
"""

from __future__ import annotations

import json
import re
from typing import Any

from rein.openai.tool_parsers import HermesParser, _arguments_json

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderParser(HermesParser):
    """`qwen3_coder` (see the module docstring)."""

    def parse_block(self, body: str) -> tuple[str, str] | None:
        function = _FUNCTION.fullmatch(body)
        if function is None:
            return None
        name = function.group(1).strip()
        if name not in self.names:
            return None
        schema = self.parameters.get(name) or {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        arguments: dict[str, Any] = {}
        inner = function.group(2)
        position = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[position:parameter.start()].strip():   # text between parameters: not this format
                return None
            position = parameter.end()
            key = parameter.group(1).strip()
            arguments[key] = convert_value(_unwrap(parameter.group(2)), properties.get(key))
        if inner[position:].strip():
            return None
        try:
            return name, _arguments_json(arguments)
        except RecursionError:
            return None


def _unwrap(value: str) -> str:
    """The value less the newline the format puts after the opening tag and before the closing one."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):     # e.g. an optional field: anyOf [{type: integer}, {type: null}]
        if isinstance(schema.get(key), list):
            return [t for option in schema[key] for t in _types(option)]
    return []


def convert_value(value: str, schema: Any) -> Any:
    """`value` as the type `schema` gives (the first that converts, in the schema's order); the
    string itself when none does or the schema allows a string first."""
    for kind in _types(schema):
        if kind == "string":
            return value
        text = value.strip()
        if kind == "null" and text == "null":
            return None
        if kind == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if number != number or number in (float("inf"), float("-inf")):   # not JSON
                continue
            return int(text) if re.fullmatch(r"[-+]?\d+", text) else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError):
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    if value.strip() == "null" and _types(schema) and "string" not in _types(schema):
        return None
    return value
