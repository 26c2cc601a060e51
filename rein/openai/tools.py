"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`,
assistant `tool_calls` and `role: "tool"` messages. This module answers: it rewrites a response
body's choices (`apply_tool_calls`) and a stream's chunks (`ToolStream`) for the request's tools.
The request side is rein.openai.tool_request, the parsing of calls out of text
rein.openai.tool_parsers.

Torch-free (the API imports it). What happens to a request, by `tool_choice`:

* ``"none"`` (the default without tools): the tools are left out of the chat template and the
  answer is plain text.
* ``"auto"`` (the default with tools): the tools go into the chat template, the model answers
  freely, and tool calls are parsed out of its text in the convention the templates teach it:
  by default Hermes-style blocks ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  (Qwen2.5, Qwen3, Hermes, and rein's tiny test model); `--tool-call-parser` or the model's
  template chooses another (rein.openai.tool_call_parsers: llama3_json, mistral, qwen3_coder). A block that does not parse, or names a function
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

from typing import Any

from rein.openai.tool_call_parsers import new_parser
from rein.openai.tool_parsers import AnswerParser, parse_required, parse_whole, tool_call
from rein.openai.tool_request import ToolRequest, request_of


def _finish_reason(request: ToolRequest, finish: str | None, has_calls: bool) -> str | None:
    if finish == "stop" and has_calls and request.choice in ("auto", "required"):
        return "tool_calls"
    return finish


def apply_tool_calls(response: dict[str, Any], body: Any, parser: str | None = None) -> dict[str, Any]:
    """Rewrite a chat.completion body's choices for the request's tools (in place; returned):
    tool calls out of the text, content, finish_reason. A body without tools is left as is.
    `parser`: the auto-mode format (rein.openai.tool_call_parsers; None: hermes)."""
    request = request_of(body, parser)
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
            content, calls = parse_whole(_auto_parser(request, seed), text)
        elif request.choice == "named":
            content, calls = None, [tool_call(seed, 0, request.name or "", text)]
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
        self._parser = _auto_parser(request, seed) if request.choice == "auto" else None
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
        return {"tool_calls": [{"index": 0, **tool_call(self.seed, 0, self.request.name or "", text)}]}


def _auto_parser(request: ToolRequest, seed: str) -> AnswerParser:
    return new_parser(request.parser, request.names, seed, request.parameters_by_name)


def stream_for(body: Any, response_id: str, index: int = 0, parser: str | None = None) -> ToolStream | None:
    """The ToolStream of choice `index` of a streamed request (None without tool handling);
    `parser` as for apply_tool_calls."""
    request = request_of(body, parser)
    if request is None or request.choice == "none":
        return None
    return ToolStream(request, f"{response_id}:{index}")
