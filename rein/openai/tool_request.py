"""A chat request's tools, validated: `tools`, `tool_choice`, `parallel_tool_calls`, the tool calls
and tool results in its messages, and what the choice asks of sampling (a structured-output
spec, a stop string). rein.openai.tools says what each tool_choice does; rein.openai.prompts
hands the tools to the chat template.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rein.core.input_checks import json_type
from rein.core.tool_call_parser_names import HERMES
from rein.openai.errors import RequestError
from rein.openai.fields import json_from_text
from rein.openai.structured_fields import check_spec
from rein.openai.tool_call_parsers import CALL_END, KEEPS_SPECIAL_TOKENS

MAX_TOOLS = 128            # OpenAI's limit on `tools`
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")     # OpenAI's rule for function names
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's validated tools and choice."""

    tools: list[dict[str, Any]]       # as given (validated), for the chat template
    choice: str                       # none | auto | required | named
    name: str | None = None           # the function of a named choice
    parallel: bool = True
    parser: str = HERMES              # the format of auto answers (rein.openai.tool_call_parsers)

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

    @property
    def parameters_by_name(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameters schema (the parsers that convert values by type read them)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}

    def extra_stop(self) -> list[str]:
        """Stop strings the choice needs: auto without parallel calls ends after the first call
        (in the formats whose calls end with a tag)."""
        end = CALL_END.get(self.parser)
        return [end] if end and self.choice == "auto" and not self.parallel else []

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether auto answers must keep special tokens (the mistral format's [TOOL_CALLS] is one)."""
        return self.choice == "auto" and self.parser in KEEPS_SPECIAL_TOKENS


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
                    raise RequestError(f"tools[{index}].function.parameters.{key}.{def_name} differs from another "
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


def parse_tools(body: dict[str, Any], parser: str | None = None) -> ToolRequest | None:
    """Validate a chat body's tools, tool_choice and parallel_tool_calls; None when the request
    involves no tools (no tools and tool_choice none/auto/absent). Errors name the field:
    `tools[2].function.name`, `tool_choice.function.name`. `parser`: the format of auto answers
    (--tool-call-parser; None: hermes)."""
    # function_call "none" / "auto" ask for what rein does anyway; functions are refused.
    for legacy, modern, accepted in (("functions", "tools", (None, [])),
                                     ("function_call", "tool_choice", (None, "none", "auto"))):
        if body.get(legacy) not in accepted:
            raise RequestError(f"{legacy} is OpenAI's deprecated form of {modern} and rein does not take it: send "
                         f"tools=[{{\"type\": \"function\", \"function\": <each function>}}] and tool_choice "
                         f"(\"auto\", \"none\", \"required\" or {{\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}) instead", legacy)
    tools = _parse_tool_list(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be a boolean, got {json_type(parallel)}", "parallel_tool_calls")
    choice, name = _parse_choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel is not False, parser or HERMES)


def _parse_tool_list(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of {{\"type\": \"function\", \"function\": {{...}}}} objects, got "
                     f"{json_type(tools)}", "tools")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools holds at most {MAX_TOOLS} tools, got {len(tools)}: send only the ones this "
                     f"request may need", "tools")
    seen: dict[str, int] = {}
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise RequestError(f"{where} must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got "
                         f"{json_type(tool)}", where)
        if tool.get("type") != "function":
            raise RequestError(f"{where}.type must be \"function\" (rein takes function tools only), got "
                         f"{json.dumps(tool.get('type'))}", f"{where}.type")
        for key in tool:
            if key not in _TOOL_KEYS:
                raise RequestError(f"{where} has an unknown field {key!r}: a tool is {{\"type\": \"function\", "
                             f"\"function\": {{...}}}}", f"{where}.{key}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise RequestError(f"{where}.function must be an object with name, description, parameters and strict, "
                         f"got {json_type(function)}", f"{where}.function")
        for key in function:
            if key not in _FUNCTION_KEYS:
                raise RequestError(f"{where}.function has an unknown field {key!r} (a function has name, "
                             f"description, parameters, strict)", f"{where}.function.{key}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, got "
                         f"{json.dumps(name)[:80]}", f"{where}.function.name")
        if name in seen:
            raise RequestError(f"{where}.function.name {name!r} is already the name of tools[{seen[name]}]: each "
                         f"tool needs its own name", f"{where}.function.name")
        seen[name] = index
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string, got {json_type(description)}",
                         f"{where}.function.description")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"{where}.function.strict must be a boolean, got {json_type(strict)}",
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
        raise RequestError(f"{where} must be a JSON Schema object, got {json_type(schema)}", where)
    kind = schema.get("type")
    if kind is not None and kind != "object":
        raise RequestError(f"{where} must describe an object (\"type\": \"object\"): a function's arguments are "
                     f"a JSON object; got \"type\": {json.dumps(kind)}", where)
    properties = schema.get("properties")
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(v, (dict, bool)) for v in properties.values())):
        raise RequestError(f"{where}.properties must be an object mapping each argument's name to its schema",
                     f"{where}.properties")
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise RequestError(f"{where}.required must be a list of argument names", f"{where}.required")


def _parse_choice(choice: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in _CHOICES:
            raise RequestError(f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:80]}", "tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice \"required\" needs tools: give the functions the model must choose from",
                         "tool_choice")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        raise RequestError("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {json.dumps(choice)[:80]}", "tool_choice")
    name = choice["function"].get("name")
    if not isinstance(name, str):
        raise RequestError(f"tool_choice.function.name must be a string, got {json_type(name)}", "tool_choice.function.name")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        among = f"the tools are {', '.join(names)}" if names else "no tools were given"
        raise RequestError(f"tool_choice names the function {name!r}, which is not among the tools ({among}): name "
                     f"one of them, or add it to tools", "tool_choice.function.name")
    return "named", name


def sampling_fields(fields: dict[str, Any], request: ToolRequest) -> None:
    """Add what the tool choice asks of sampling to SamplingParams' `fields`: the structured spec
    of a named or required choice, the stop string of auto without parallel calls."""
    structured = request.structured()
    if structured is not None:
        if fields.get("structured") is not None:
            raise RequestError("tool_choice \"required\" or a named function constrains the output to the tools' "
                         "arguments, which cannot be combined with response_format or structured_outputs (also "
                         "a constraint): leave out one of them", "tool_choice")
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
        raise RequestError(f"this model's chat template has no tool support (it never uses `tools`), so the model "
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
            raise RequestError(f"{where}.name must be a string, got {json_type(name)}", f"{where}.name")
        fields["name"] = name
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"{where}.tool_call_id must be a string (the id of the assistant's tool call this "
                         f"message answers), got {json_type(call_id)}", f"{where}.tool_call_id")
        fields["tool_call_id"] = call_id
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return fields
    if role != "assistant":
        raise RequestError(f"{where}.tool_calls: only assistant messages carry tool calls (this one is {role!r})",
                     f"{where}.tool_calls")
    if not isinstance(calls, list):
        raise RequestError(f"{where}.tool_calls must be a list of tool calls, got {json_type(calls)}", f"{where}.tool_calls")
    fields["tool_calls"] = [_template_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    return fields


def _template_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                     f"\"arguments\": ...}}}}", where)
    if call.get("type", "function") != "function":
        raise RequestError(f"{where}.type must be \"function\", got {json.dumps(call.get('type'))}", f"{where}.type")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise RequestError(f"{where}.id must be a string, got {json_type(call_id)}", f"{where}.id")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.function.name must be a non-empty string, got {json_type(name)}", f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json_from_text(arguments, f"{where}.function.arguments") if arguments.strip() else {}
        except RequestError as exc:
            raise RequestError(f"{exc.message}: send the arguments the tool call was made with, a JSON object "
                               f"as a string", exc.param) from None
    if not isinstance(arguments, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object (as a string), got {json_type(arguments)}",
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


def request_of(body: Any, parser: str | None = None) -> ToolRequest | None:
    """The tool request of a stored, already validated body; None if it has no tools (or no
    longer validates: an answer is rebuilt plain rather than not at all). `parser`: the one
    stored with the job (None: hermes, as jobs stored before there was a choice)."""
    if not isinstance(body, dict) or not body.get("tools"):
        return None
    try:
        return parse_tools(body, parser)
    except ValueError:
        return None
