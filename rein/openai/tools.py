"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
assistant `tool_calls` and `role: "tool"` messages.

Torch-free (the API imports it). What happens to a request, by `tool_choice`:

* ``"none"`` (the default without tools): the tools are left out of the chat template and the
  answer is plain text.
* ``"auto"`` (the default with tools): the tools go into the chat template, the model answers
  freely, and tool calls are parsed out of its text in the convention the templates teach it:
  Hermes-style blocks ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5,
  Qwen3, Hermes, and rein's tiny test model). A block that does not parse, or names a function
  that is not among the tools, stays in the content as text (vLLM's hermes parser keeps a
  malformed answer as content too). Whitespace next to a parsed block is dropped (the
  template's formatting); an answer without parsed blocks is returned exactly as written.
* A named function (``{"type": "function", "function": {"name": ...}}``): the output is
  constrained (rein.engine.structured, `SamplingParams.structured`) to that function's `parameters`
  schema, and the answer is one tool call whose `arguments` is the generated text.
* ``"required"``: the output is constrained to a JSON array of at least one
  ``{"name": <a tool's name>, "parameters": <that tool's parameters>}`` object (at most one
  when `parallel_tool_calls` is false) — vLLM's schema for `required`
  (`_get_json_schema_from_tools`, tool_parsers/utils.py), with no other keys in an element —
  and each element becomes a call.

finish_reason follows OpenAI (as vLLM does since vllm-project/vllm#25054): "tool_calls" for
auto and required answers that hold calls, "stop" for a named function; an answer cut by
max_tokens keeps "length" whatever it holds. `content` is null when the answer is only calls.

Tool call ids are derived from the response id, the choice and the call's position
(``call_<24 hex>``), not random: the same job's body is rebuilt from Postgres for every
GET /v1/jobs/{id}, every batch output view and the streamed chunks, and they must agree.

A function's `strict: true` is accepted: named and required choices are constrained to the
schema anyway; in auto mode the arguments are the model's own (as in vLLM), not constrained.

`parallel_tool_calls: false` in auto mode adds ``</tool_call>`` to the stop strings: the
answer ends after its first call (the block is then unclosed, which the parser accepts when
its JSON is complete, as vLLM's regex does).

The legacy `functions` / `function_call` fields are refused with a 400 that says how to write
them as `tools` / `tool_choice` (vLLM does not take them either; mapping them would also mean
answering in the legacy `message.function_call` shape).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from rein.core.input_checks import json_type

MAX_TOOLS = 128            # OpenAI's limit on `tools`
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _error(message: str, param: str | None) -> Exception:
    # Imported here: rein.openai.request imports this module.
    from rein.openai.errors import RequestError
    return RequestError(message, param)




@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tools and choice."""

    tools: list[dict[str, Any]]       # as given (validated), for the chat template
    choice: str                       # none | auto | required | named
    name: str | None = None           # the function of a named choice
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (none for tool_choice "none")."""
        return self.tools if self.tools and self.choice != "none" else None

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or dict(_EMPTY_PARAMETERS)
        raise KeyError(name)

    def structured(self) -> dict[str, Any] | None:
        """The `SamplingParams.structured` spec a named or required choice constrains the output to."""
        if self.choice == "named":
            return {"type": "json_schema", "schema": self.parameters(self.name or "")}
        if self.choice == "required":
            return {"type": "json_schema", "schema": required_schema(self.tools, self.parallel)}
        return None

    def structured_param(self) -> str:
        """The parameter to name when the structured spec cannot be enforced (rein.engine.structured)."""
        if self.choice == "named":
            index = [t["function"]["name"] for t in self.tools].index(self.name)
            return f"tools[{index}].function.parameters"
        return "tools"

    def extra_stop(self) -> list[str]:
        """Stop strings the choice needs: auto without parallel calls ends after the first call."""
        return [TOOL_CALL_END] if self.choice == "auto" and not self.parallel else []


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": an array of {name, parameters} objects, one
    alternative per tool. The tools' `$defs` move to the root, where their `#/$defs/...`
    references resolve (as vLLM does); two tools defining one name differently are refused."""
    alternatives, defs = [], {}
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = dict(function.get("parameters") or _EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                if def_name in defs and defs[def_name] != schema:
                    raise _error(f"tools[{index}].function.parameters.{key}.{def_name} differs from another "
                                 f"tool's definition of the same name; tool_choice \"required\" combines the "
                                 f"tools' schemas into one, so rename one of them",
                                 f"tools[{index}].function.parameters")
                defs[def_name] = schema
        # additionalProperties false (vLLM leaves it open): a call holds its name and parameters
        # only, and the output cannot run on with keys the answer would drop anyway.
        alternatives.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# -- requests ---------------------------------------------------------------------------------


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """Validate a chat body's tools, tool_choice and parallel_tool_calls; None when the request
    involves no tools (no tools and tool_choice none/auto/absent). Errors name the field:
    `tools[2].function.name`, `tool_choice.function.name`."""
    # function_call "none" / "auto" ask for what rein does anyway; functions are refused.
    for legacy, modern, accepted in (("functions", "tools", (None, [])),
                                     ("function_call", "tool_choice", (None, "none", "auto"))):
        if body.get(legacy) not in accepted:
            raise _error(f"{legacy} is OpenAI's deprecated form of {modern} and rein does not take it: send "
                         f"tools=[{{\"type\": \"function\", \"function\": <each function>}}] and tool_choice "
                         f"(\"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}) instead", legacy)
    tools = _parse_tool_list(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error(f"parallel_tool_calls must be a boolean, got {json_type(parallel)}", "parallel_tool_calls")
    choice, name = _parse_choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel is not False)


def _parse_tool_list(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _error(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, got "
                     f"{json_type(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise _error(f"tools holds at most {MAX_TOOLS} tools, got {len(tools)}: send only the ones this "
                     f"request may need", "tools")
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise _error(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got "
                         f"{json_type(tool)}", where)
        if tool.get("type") != "function":
            raise _error(f"{where}.type must be \"function\" (rein takes function tools only), got "
                         f"{json.dumps(tool.get('type'))}", f"{where}.type")
        for key in tool:
            if key not in _TOOL_KEYS:
                raise _error(f"{where} has an unknown field {key!r}: a tool is {{\"type\": \"function\", "
                             f"\"function\": {{...}}}}", f"{where}.{key}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise _error(f"{where}.function must be an object with name, description, parameters and strict, "
                         f"got {json_type(function)}", f"{where}.function")
        for key in function:
            if key not in _FUNCTION_KEYS:
                raise _error(f"{where}.function has an unknown field {key!r} (a function has name, "
                             f"description, parameters, strict)", f"{where}.function.{key}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _error(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                         f"{json.dumps(name)[:80]}", f"{where}.function.name")
        if name in seen:
            raise _error(f"{where}.function.name {name!r} is already the name of tools[{seen[name]}]: each "
                         f"tool needs its own name", f"{where}.function.name")
        seen[name] = index
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _error(f"{where}.function.description must be a string, got {json_type(description)}",
                         f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _error(f"{where}.function.strict must be a boolean, got {json_type(strict)}",
                         f"{where}.function.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_parameters(parameters, f"{where}.function.parameters")
    return tools


def _check_parameters(schema: Any, where: str) -> None:
    """The shape OpenAI asks of a function's parameters: a JSON Schema object describing an object.
    (Whether rein can constrain output to every keyword in it is the grammar compiler's check,
    rein.engine.structured, for the choices that constrain.)"""
    if not isinstance(schema, dict):
        raise _error(f"{where} must be a JSON Schema object, got {json_type(schema)}", where)
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise _error(f"{where} must describe an object (\"type\": \"object\"): a function's arguments are "
                     f"a JSON object; got \"type\": {json.dumps(kind)}", where)
    properties = schema.get("properties")
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(v, (dict, bool)) for v in properties.values())):
        raise _error(f"{where}.properties must be an object mapping each argument's name to its schema",
                     f"{where}.properties")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise _error(f"{where}.required must be a list of argument names", f"{where}.required")


def _parse_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise _error(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:80]}", "tool_choice")
        if choice == "required" and not tools:
            raise _error("tool_choice \"required\" needs tools: give the functions the model must choose from",
                         "tool_choice")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise _error("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {json.dumps(choice)[:80]}", "tool_choice")
    name = choice["function"].get("name")
    if not isinstance(name, str):
        raise _error(f"tool_choice.function.name must be a string, got {json_type(name)}", "tool_choice.function.name")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        among = f"the tools are {', '.join(names)}" if names else "no tools were given"
        raise _error(f"tool_choice names the function {name!r}, which is not among the tools ({among}): name "
                     f"one of them, or add it to tools", "tool_choice.function.name")
    return "named", name


def sampling_fields(fields: dict[str, Any], request: ToolRequest) -> None:
    """Add what the tool choice asks of sampling to SamplingParams' `fields`: the structured spec
    of a named or required choice, the stop string of auto without parallel calls."""
    structured = request.structured()
    if structured is not None:
        if fields.get("structured") is not None:
            raise _error("tool_choice \"required\" or a named function constrains the output to the tools' "
                         "arguments, which cannot be combined with response_format or structured_outputs (also "
                         "a constraint): leave out one of them", "tool_choice")
        # Imported here: rein.engine.structured.request imports rein.openai.request, which imports this.
        from rein.engine.structured.request import check_spec

        check_spec(structured, request.structured_param())   # a keyword llguidance cannot enforce: 400
        fields["structured"] = structured
    extra = request.extra_stop()
    if extra:
        stop = fields.get("stop") or []
        fields["stop"] = [*([stop] if isinstance(stop, str) else stop), *extra]


def check_template(chat_template: Any, request: ToolRequest | None) -> None:
    """A template that never mentions `tools` cannot show them to the model: refuse a request
    that relies on it (auto, required, named) rather than answer without the tools."""
    if request is None or request.template_tools is None:
        return
    template = chat_template
    if isinstance(template, dict):    # named templates: transformers takes "tool_use" for tools
        template = template.get("tool_use") or template.get("default") or ""
    if not isinstance(template, str) or "tools" not in template:
        raise _error(f"this model's chat template has no tool support (it never uses `tools`), so the model "
                     f"cannot see the functions: leave out tools, or send tool_choice \"none\" (tool_choice "
                     f"is {json.dumps(request.choice if request.choice != 'named' else 'a named function')})",
                     "tools")


def template_message_fields(message: dict[str, Any], role: str, where: str) -> dict[str, Any]:
    """The fields of a message beyond {role, content} that chat templates read: an assistant's
    `tool_calls` (arguments parsed into an object, as vLLM passes them: Qwen's template writes
    `arguments | tojson`), a tool message's `tool_call_id`, and `name`."""
    fields: dict[str, Any] = {}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise _error(f"{where}.name must be a string, got {json_type(name)}", f"{where}.name")
        fields["name"] = name
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise _error(f"{where}.tool_call_id must be a string (the id of the assistant's tool call this "
                         f"message answers), got {json_type(call_id)}", f"{where}.tool_call_id")
        fields["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return fields
    if role != "assistant":
        raise _error(f"{where}.tool_calls: only assistant messages carry tool calls (this one is {role!r})",
                     f"{where}.tool_calls")
    if not isinstance(calls, list):
        raise _error(f"{where}.tool_calls must be a list of tool calls, got {json_type(calls)}", f"{where}.tool_calls")
    fields["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    return fields


def _template_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise _error(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                     f"\"arguments\": ...}}}}", where)
    if call.get("type", "function") != "function":
        raise _error(f"{where}.type must be \"function\", got {json.dumps(call.get('type'))}", f"{where}.type")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise _error(f"{where}.id must be a string, got {json_type(call_id)}", f"{where}.id")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _error(f"{where}.function.name must be a non-empty string, got {json_type(name)}", f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise _error(f"{where}.function.arguments is not valid JSON ({exc.msg} at column {exc.colno}): "
                         f"send the arguments the tool call was made with, a JSON object as a string",
                         f"{where}.function.arguments") from None
    if not isinstance(arguments, dict):
        raise _error(f"{where}.function.arguments must be a JSON object (as a string), got {json_type(arguments)}",
                     f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


def template_chars(messages: list[dict[str, Any]], request: ToolRequest | None) -> int:
    """Characters the template will add beyond the messages' contents (tool calls, tools), for
    the prompt-size check made before templating."""
    chars = sum(len(json.dumps(m["tool_calls"])) for m in messages if "tool_calls" in m)
    if request is not None and request.template_tools is not None:
        chars += len(json.dumps(request.template_tools))
    return chars


# -- answers ----------------------------------------------------------------------------------


def call_id(seed: str, index: int) -> str:
    """OpenAI's `call_...` id, derived from the response (see the module docstring)."""
    return "call_" + hashlib.sha256(f"{seed}:{index}".encode()).hexdigest()[:24]


def _call(seed: str, index: int, name: str, arguments: str) -> dict[str, Any]:
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
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", {})
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


class HermesParser:
    """Incremental parser of an auto-mode answer: text in, content and tool-call deltas out.

    One machine for whole answers and streams, so the streamed content concatenates to the
    non-streamed one: text is content until `<tool_call>` (a partial tag at the end of the text
    so far is held back), a block is held until `</tool_call>` and then becomes a call or, when
    malformed, content. Whitespace is held back until text follows it: whitespace around parsed
    calls, before the first text or at the end of an answer with calls is dropped.
    """

    def __init__(self, names: frozenset[str], seed: str) -> None:
        self.names = names
        self.seed = seed
        self.calls: list[dict[str, Any]] = []
        self._buffer = ""
        self._held = ""            # trailing whitespace of the content so far
        self._in_block = False
        self._after_call = False
        self._emitted = False      # any content yet

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for `text`: {"content": str} or {"tool_calls": [{index, id, type, function}]}."""
        out: list[dict[str, Any]] = []
        self._buffer += text
        while True:
            if not self._in_block:
                start = self._buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_tag(self._buffer, TOOL_CALL_START)
                    cut = len(self._buffer) - keep
                    self._content(self._buffer[:cut], out)
                    self._buffer = self._buffer[cut:]
                    return out
                self._content(self._buffer[:start], out)
                self._buffer = self._buffer[start + len(TOOL_CALL_START):]
                self._in_block = True
            else:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return out
                body = self._buffer[:end]
                self._buffer = self._buffer[end + len(TOOL_CALL_END):]
                self._in_block = False
                self._close(body, TOOL_CALL_START + body + TOOL_CALL_END, out)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the answer releases: an unclosed last block (a call when its JSON
        is complete: the answer may stop at `</tool_call>` or EOS), held-back text."""
        out: list[dict[str, Any]] = []
        if self._in_block:
            self._in_block = False
            self._close(self._buffer, TOOL_CALL_START + self._buffer, out)
        else:
            self._content(self._buffer, out)
        self._buffer = ""
        if self._held and not self.calls:     # no calls: the answer comes back exactly as written
            out.append({"content": self._held})
        self._held = ""
        return out

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

    def _close(self, body: str, raw: str, out: list[dict[str, Any]]) -> None:
        parsed = parse_call_block(body, self.names)
        if parsed is None:
            self._content(raw, out)
            return
        index = len(self.calls)
        call = _call(self.seed, index, *parsed)
        self.calls.append(call)
        self._held = ""
        self._after_call = True
        out.append({"tool_calls": [{"index": index, **call}]})


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (a tag still arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parse_hermes(text: str, names: frozenset[str], seed: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole auto-mode answer; the content is the text unchanged when
    it holds no call, else the text outside the calls (None if nothing is left)."""
    parser = HermesParser(names, seed)
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
            calls.append(_call(seed, len(calls), item["name"], arguments))
    return calls


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _finish_reason(request: ToolRequest, finish: str | None, has_calls: bool) -> str | None:
    if finish == "stop" and has_calls and request.choice in ("auto", "required"):
        return "tool_calls"
    return finish


def request_of(body: Any) -> ToolRequest | None:
    """The tool request of a stored, already validated body; None if it has no tools (or no
    longer validates: an answer is rebuilt plain rather than not at all)."""
    if not isinstance(body, dict) or not body.get("tools"):
        return None
    try:
        return parse_tools(body)
    except ValueError:
        return None


def apply_tool_calls(response: dict[str, Any], body: Any) -> dict[str, Any]:
    """Rewrite a chat.completion body's choices for the request's tools (in place; returned):
    tool calls out of the text, content, finish_reason. A body without tools is left as is."""
    request = request_of(body)
    if request is None or request.choice == "none" or response.get("object") != "chat.completion":
        return response
    for position, choice in enumerate(response.get("choices") or []):
        message = choice.get("message")
        if not isinstance(message, dict):
            continue
        seed = f"{response.get('id')}:{choice.get('index', position)}"
        text = message.get("content") or ""
        finish = choice.get("finish_reason")
        if request.choice == "auto":
            content, calls = parse_hermes(text, request.names, seed)
        elif request.choice == "named":
            content, calls = None, [_call(seed, 0, request.name or "", text)]
        else:
            calls = parse_required(text, request.names, seed)
            content = None if calls else text
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
        choice["finish_reason"] = _finish_reason(request, finish, bool(calls))
    return response


class ToolStream:
    """One streamed choice's text turned into chat.completion.chunk deltas for its tools.

    auto: content streams until a `<tool_call>`, each call comes as one delta when its block
    closes (or at the end). named: the call's id and name come first, then the arguments as the
    text streams. required: the calls come at the end (the array is parsed whole)."""

    def __init__(self, request: ToolRequest, seed: str) -> None:
        self.request = request
        self.seed = seed
        self._parser = HermesParser(request.names, seed) if request.choice == "auto" else None
        self._text: list[str] = []
        self._started = False
        self._has_calls = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._parser is not None:
            deltas = self._parser.feed(text)
            self._has_calls = bool(self._parser.calls)
            return deltas
        if self.request.choice == "named":
            return [self._named_delta(text)]
        self._text.append(text)
        return []

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The last deltas and the choice's finish_reason (for the engine's mapped one)."""
        deltas: list[dict[str, Any]] = []
        if self._parser is not None:
            deltas = self._parser.finish()
            self._has_calls = bool(self._parser.calls)
        elif self.request.choice == "named":
            if not self._started:
                deltas = [self._named_delta("")]
        elif self.request.choice == "required":
            text = "".join(self._text)
            calls = parse_required(text, self.request.names, self.seed)
            if calls:
                deltas = [{"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}]
                self._has_calls = True
            elif text:
                deltas = [{"content": text}]
        return deltas, _finish_reason(self.request, finish_reason, self._has_calls)

    def _named_delta(self, text: str) -> dict[str, Any]:
        if self._started:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self._started = True
        self._has_calls = True
        return {"tool_calls": [{"index": 0, **_call(self.seed, 0, self.request.name or "", text)}]}


def stream_for(body: Any, response_id: str, index: int = 0) -> ToolStream | None:
    """The ToolStream of choice `index` of a streamed request (None without tool handling)."""
    request = request_of(body)
    if request is None or request.choice == "none":
        return None
    return ToolStream(request, f"{response_id}:{index}")
