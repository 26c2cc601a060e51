"""OpenAI's Responses API (`POST /v1/responses`), its stateless subset, on rein's chat machinery.

A Responses request is translated into a chat-completions body (`chat_body`), which then
goes through everything a chat request does (rein.openai.request.parse_request: the chat
template, limits, structured outputs, tools); the job keeps the Responses body as it came
(`params["body"]`), so translating it again gives the same chat body. The finished
chat.completion body, after tool parsing (rein.openai.tools.apply_tool_calls), becomes a
`response` object (rein.openai.responses_body.response_from_chat). Streaming:
rein.openai.responses_stream.

What each request field does:

* `input`: a string (one user message) or a list of items: messages (`role` user, system,
  developer or assistant; `content` a string or `input_text` / `output_text` parts), earlier
  `function_call` items (an assistant's tool calls) and `function_call_output` items (the
  tool's answers, as `role: "tool"` messages). `input_image` parts (an image URL or a file id,
  rein.openai.images) go to the chat body as they are, for a vision model. `reasoning` items are accepted and left out of
  the prompt (chat templates drop earlier thinking too). `instructions`: a system message first.
* `max_output_tokens` -> `max_tokens`; `temperature`, `top_p` as in chat; `text.format`
  (`text`, `json_object`, `json_schema` with name / schema / strict / description) ->
  `response_format`; function `tools` (Responses' flat shape) and `tool_choice` -> chat's;
  `parallel_tool_calls` as in chat.
* `reasoning` ({effort, summary}): checked and echoed; effort does not change rein's
  decoding. Reasoning text comes from the chat message's `reasoning_content` (a model served
  with a reasoning parser) as a `reasoning` item; with `summary` asked, the summary holds
  that same text (rein does not summarize).
* `metadata`: echoed back. `store`: accepted either way and echoed; rein keeps the job (GET
  /v1/jobs) as for every request, but offers no stored-response retrieval, so
  `previous_response_id` is refused.
* Refused with a 400 that says what to do instead: `previous_response_id`, `conversation`,
  `prompt`, `background: true`, built-in tools (web search, file search, ...), input parts
  other than text and images, `include`, `truncation: "auto"`, `top_logprobs`, `max_tool_calls`, and any field
  Responses does not define (as chat refuses unknown fields).

Torch-free: the API imports it.
"""

from __future__ import annotations

import json
from typing import Any

from rein.core.input_checks import json_type
from rein.openai.endpoints import CHAT_COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.fields import get_field
from rein.openai.request import ParsedRequest, parse_request

# The Responses fields rein reads (the translation below says how).
_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "tools",
    "tool_choice", "parallel_tool_calls", "reasoning", "metadata", "store", "stream", "stream_options",
    "truncation", "include", "background", "top_logprobs", "max_tool_calls"})
# Passed to the chat body as they are: OpenAI's bookkeeping fields, and the sampling extras
# vLLM's Responses endpoint also takes (the official client sends them through extra_body).
_PASSED_TO_CHAT = frozenset({
    "user", "safety_identifier", "prompt_cache_key", "service_tier", "priority", "seed", "stop", "top_k",
    "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"})
# Fields that need what rein does not keep: stored responses, conversations, prompts, a
# background runner. Each with what to do instead.
_STATEFUL_FIELDS = {
    "previous_response_id": "rein stores no responses to continue from: send the earlier turns in `input` "
                            "(its output items included)",
    "conversation": "rein stores no conversations: send the earlier turns in `input`",
    "prompt": "rein stores no prompt templates: send the prompt's text as `instructions` and `input`",
    "context_management": "rein does not compact conversations: send the turns you want in `input`",
}
_BACKGROUND = ("background responses are not supported by rein: to run a request in the background, send it "
               "to POST /v1/jobs with endpoint \"/v1/responses\" (or as a batch) and poll GET /v1/jobs/{id}")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed")
_TEXT_PART_TYPES = ("input_text", "output_text", "text")
# OpenAI's limits on metadata (rein.api.jobs.check_metadata holds the same for jobs).
_MAX_METADATA_PAIRS = 16
_MAX_METADATA_KEY_LEN = 64
_MAX_METADATA_VALUE_LEN = 512


def chat_body(body: Any) -> dict[str, Any]:
    """The chat-completions body a Responses request runs as (RequestError 400 naming the
    Responses field for what rein does not take)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", "body")
    _refuse_unsupported(body)
    chat: dict[str, Any] = {}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    messages = []
    instructions = get_field(body, "instructions", str)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    messages.extend(_messages(body.get("input")))
    chat["messages"] = messages
    max_output_tokens = get_field(body, "max_output_tokens", int)
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("stream"):
        # The stream's last event carries the usage (rein.openai.responses_stream).
        chat["stream_options"] = {"include_usage": True}
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    _check_reasoning(body.get("reasoning"))
    check_metadata(body.get("metadata"))
    get_field(body, "store", bool)
    for name in _PASSED_TO_CHAT:
        if name in body:
            chat[name] = body[name]
    return chat


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in _STATEFUL_FIELDS:
            if value is None:
                continue
            raise RequestError(f"{name} is not supported: {_STATEFUL_FIELDS[name]}", name, code="unsupported_parameter")
        if name not in _FIELDS and name not in _PASSED_TO_CHAT:
            raise RequestError(f"Unrecognized request argument supplied: {name} (rein's /v1/responses does not "
                               "take it; remove it)", name)
    if get_field(body, "background", bool):
        raise RequestError(_BACKGROUND, "background", code="unsupported_parameter")
    if get_field(body, "truncation", str, "disabled") != "disabled":
        raise RequestError(f"truncation={json.dumps(body['truncation'])} is not supported: rein never drops "
                           "input to fit the context (a prompt too long is refused); leave it out or send "
                           "\"disabled\"", "truncation", code="unsupported_parameter")
    include = get_field(body, "include", list, [])
    if include:
        raise RequestError(f"include={json.dumps(include)[:80]} is not supported: rein returns no encrypted "
                           "reasoning, logprobs or tool sources on /v1/responses; leave include out",
                           "include", code="unsupported_parameter")
    if get_field(body, "top_logprobs", int, 0) != 0:
        raise RequestError("top_logprobs is not supported on rein's /v1/responses: ask "
                           "/v1/chat/completions with logprobs for them", "top_logprobs",
                           code="unsupported_parameter")
    if body.get("max_tool_calls") is not None:
        raise RequestError("max_tool_calls is not supported: rein runs no built-in tools, and function calls "
                           "come back to you to run; leave it out (parallel_tool_calls: false allows one "
                           "call)", "max_tool_calls", code="unsupported_parameter")
    options = get_field(body, "stream_options", dict, {})
    if set(options) - {"include_obfuscation"}:
        raise RequestError("stream_options takes only include_obfuscation on /v1/responses (the usage is "
                           "always in the last event)", "stream_options")


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError(f"input must be a string or a non-empty list of items, got {json_type(value)}", "input")
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(value):
        where = f"input[{position}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object (a message or a function_call / function_call_output "
                               f"item), got {json_type(item)}", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            # Calls in a row (and calls right after the assistant's text) are one assistant turn.
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, where))
        elif kind == "reasoning":
            continue   # earlier thinking: chat templates leave it out of the prompt too
        elif kind == "item_reference":
            raise RequestError(f"{where}: item_reference is not supported: rein stores no items to refer to; send "
                               "the item itself", f"{where}.type", code="unsupported_parameter")
        else:
            raise RequestError(f"{where}.type {json.dumps(kind)[:60]} is not supported: rein's /v1/responses takes "
                               "message, function_call, function_call_output and reasoning items",
                               f"{where}.type", code="unsupported_parameter")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestError(f"{where}.role must be user, system, developer or assistant, got {json.dumps(role)[:60]}",
                           f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of input_text parts, got "
                           f"{json_type(content)}", f"{where}.content")
    texts = []
    parts: list[dict[str, Any]] = []   # with images: text and image parts, in order
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and role == "assistant":
            texts.append(get_field(part, "refusal", str, ""))
            parts.append({"type": "text", "text": texts[-1]})
            continue
        if kind == "input_image" and role != "assistant":
            # Passed on as it is: the chat parser checks it (rein.openai.images), and says so when
            # the model takes no images.
            parts.append(part)
            continue
        if kind not in _TEXT_PART_TYPES:
            shown = json.dumps(kind)[:60] if kind is not None else json_type(part)
            raise RequestError(f"{at}: a {shown} part is not supported: send text as input_text parts and images "
                               "as input_image parts", f"{at}.type", code="unsupported_parameter")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{at}.text must be a string, got {json_type(text)}", f"{at}.text")
        texts.append(text)
        parts.append({"type": "text", "text": text})
    if len(parts) != len(texts):
        return {"role": role, "content": parts}
    return {"role": role, "content": "".join(texts)}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    fields = {}
    for name in ("call_id", "name", "arguments"):
        value = item.get(name)
        if not isinstance(value, str):
            raise RequestError(f"{where}.{name} must be a string, got {json_type(value)}", f"{where}.{name}")
        fields[name] = value
    return {"id": fields["call_id"], "type": "function",
            "function": {"name": fields["name"], "arguments": fields["arguments"]}}


def _function_call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.call_id must be the call_id of the function_call it answers",
                           f"{where}.call_id")
    output = item.get("output")
    if isinstance(output, list):   # parts: text only
        output = _message({"role": "user", "content": output}, f"{where}.output")["content"]
    if not isinstance(output, str):
        raise RequestError(f"{where}.output must be a string, got {json_type(output)}", f"{where}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError(f"text must be an object such as {{\"format\": {{\"type\": \"json_object\"}}}}, got "
                           f"{json_type(text)}", "text")
    extra = set(text) - {"format", "verbosity"}
    if extra:
        raise RequestError(f"text takes format (and verbosity), not {', '.join(sorted(extra))}", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise RequestError(f"text.verbosity={json.dumps(text['verbosity'])[:40]} is not supported: rein cannot "
                           "steer an answer's length that way; leave it out and set max_output_tokens or "
                           "instructions", "text.verbosity", code="unsupported_parameter")
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise RequestError(f"text.format must be an object such as {{\"type\": \"json_schema\", \"name\": ..., "
                           f"\"schema\": ...}}, got {json_type(spec)}", "text.format")
    kind = spec.get("type")
    if kind in ("text", "json_object"):
        if set(spec) != {"type"}:
            raise RequestError(f"text.format of type {kind} takes no other keys", "text.format")
        return {"type": kind}
    if kind != "json_schema":
        raise RequestError(f"text.format.type must be text, json_object or json_schema, got "
                           f"{json.dumps(kind)[:40]}", "text.format.type")
    inner = {name: value for name, value in spec.items() if name != "type"}
    extra = set(inner) - {"name", "schema", "strict", "description"}
    if extra:
        raise RequestError(f"text.format (json_schema) takes name, schema, strict and description, not "
                           f"{', '.join(sorted(extra))}", "text.format")
    return {"type": "json_schema", "json_schema": inner}


def _tools(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise RequestError(f"tools must be a list of function tools, got {json_type(value)}", "tools")
    tools = []
    for position, tool in enumerate(value):
        where = f"tools[{position}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            shown = json.dumps(kind)[:60] if kind is not None else json_type(tool)
            raise RequestError(f"{where}: the {shown} tool is not supported: rein runs no built-in tools (web "
                               "search, file search, code interpreter, MCP, ...); declare a function tool "
                               "{\"type\": \"function\", \"name\", \"parameters\"} and run it yourself",
                               f"{where}.type", code="unsupported_parameter")
        extra = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if extra:
            raise RequestError(f"{where}: a function tool takes name, description, parameters and strict, not "
                               f"{', '.join(sorted(extra))}", where)
        function = {name: tool[name] for name in ("name", "description", "parameters", "strict") if name in tool}
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        return value   # none | auto | required: chat checks the word
    if isinstance(value, dict) and value.get("type") == "function":
        if set(value) - {"type", "name"} or not isinstance(value.get("name"), str):
            raise RequestError("tool_choice naming a function is {\"type\": \"function\", \"name\": <a tool's "
                               "name>}", "tool_choice")
        return {"type": "function", "function": {"name": value["name"]}}
    kind = value.get("type") if isinstance(value, dict) else json_type(value)
    raise RequestError(f"tool_choice {json.dumps(kind)[:60]} is not supported: use \"auto\", \"none\", "
                       "\"required\" or {\"type\": \"function\", \"name\": ...} (rein runs no built-in tools)",
                       "tool_choice", code="unsupported_parameter")


def _check_reasoning(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError(f"reasoning must be an object {{\"effort\", \"summary\"}}, got {json_type(value)}",
                           "reasoning")
    extra = set(value) - {"effort", "summary", "generate_summary"}
    if extra:
        raise RequestError(f"reasoning takes effort and summary, not {', '.join(sorted(extra))}", "reasoning")
    if value.get("effort") not in (None, *_EFFORTS):
        raise RequestError(f"reasoning.effort must be one of {', '.join(_EFFORTS)}, got "
                           f"{json.dumps(value['effort'])[:40]}", "reasoning.effort")
    for name in ("summary", "generate_summary"):
        if value.get(name) not in (None, *_SUMMARIES):
            raise RequestError(f"reasoning.{name} must be one of {', '.join(_SUMMARIES)}, got "
                               f"{json.dumps(value[name])[:40]}", f"reasoning.{name}")


def check_metadata(value: Any) -> None:
    """OpenAI's rules for `metadata`: at most 16 string pairs, keys up to 64 characters,
    values up to 512."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise RequestError(f"metadata must be an object of string keys and values, got {json_type(value)}",
                           "metadata")
    if len(value) > _MAX_METADATA_PAIRS:
        raise RequestError(f"metadata holds at most {_MAX_METADATA_PAIRS} pairs, got {len(value)}", "metadata")
    for name, text in value.items():
        if not isinstance(text, str):
            raise RequestError(f"metadata values must be strings; '{name[:80]}' is {json_type(text)}", "metadata")
        if len(name) > _MAX_METADATA_KEY_LEN or len(text) > _MAX_METADATA_VALUE_LEN:
            raise RequestError(f"metadata keys are at most {_MAX_METADATA_KEY_LEN} characters and values at most "
                               f"{_MAX_METADATA_VALUE_LEN}; '{name[:80]}' is longer", "metadata")


def parse_responses_request(body: Any, tokenizer: Any, max_model_len: int,
                            generation_defaults: Any = None, tool_parser: str | None = None,
                            reasoning: Any = None, images: Any = None) -> ParsedRequest:
    """A Responses request parsed as the chat request it runs as (rein.openai.request.parse_request;
    `images`: its rein.openai.images.PromptImages); its errors name the Responses fields."""
    try:
        return parse_request(CHAT_COMPLETIONS, chat_body(body), tokenizer, max_model_len, generation_defaults,
                             tool_parser, reasoning, images)
    except RequestError as exc:
        raise responses_error(exc) from None


# Chat's names for a field in its errors -> the Responses field the user wrote.
_CHAT_PARAMS = (("response_format.json_schema", "text.format"), ("response_format", "text.format"),
                ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"),
                ("messages", "input"))


def responses_error(error: RequestError) -> RequestError:
    """A chat body's RequestError, with the Responses fields named instead of the chat ones."""
    message, param = error.message, error.param
    for chat_name, name in _CHAT_PARAMS:
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):
            param = name + param[len(chat_name):]
    return RequestError(message, param, code=error.code)
