"""Tool calling (rein.openai.tool_request, tool_parsers, tools): request validation, the constrained
choices' specs, Hermes parsing of auto answers, tool messages through the chat template, and the response bodies and stream
chunks built with the request's tools."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from datetime import UTC, datetime

import pytest
from transformers import AutoTokenizer

from rein.api.streams import StreamEvent, openai_chunk_stream
from rein.jobs.results import response_body
from rein.openai import tool_parsers, tool_request, tools
from rein.openai.endpoints import CHAT_COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.prompts import chat_prompt
from rein.openai.request import parse_request
from rein.openai.response import build_response
from rein.store.tables import Job, Result

MAX_LEN = 2048
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
NAMES = frozenset({"get_weather", "get_time"})
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def parse(tokenizer, **body):
    return parse_request(CHAT_COMPLETIONS, {"messages": USER, **body}, tokenizer, MAX_LEN)


def error_of(tokenizer, **body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse(tokenizer, **body)
    return info.value


def fn(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


# -- requests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("body,param,words", [
    ({"tools": {"type": "function"}}, "tools", "must be a list"),
    ({"tools": [fn(str(i)) for i in range(129)]}, "tools", "at most 128"),
    ({"tools": ["get_weather"]}, "tools[0]", "must be an object"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "\"function\""),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "must be an object"),
    ({"tools": [{"type": "function", "function": {"name": "f"}, "extra": 1}]}, "tools[0].extra", "unknown field"),
    ({"tools": [fn(), fn("g", examples=[])]}, "tools[1].function.examples", "unknown field"),
    ({"tools": [fn("has space")]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [fn("x" * 65)]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "1 to 64"),
    ({"tools": [fn("f"), fn("g"), fn("f")]}, "tools[2].function.name", "already the name of tools[0]"),
    ({"tools": [fn(description=3)]}, "tools[0].function.description", "string"),
    ({"tools": [fn(strict="yes")]}, "tools[0].function.strict", "boolean"),
    ({"tools": [fn(parameters="{}")]}, "tools[0].function.parameters", "JSON Schema object"),
    ({"tools": [fn(parameters={"type": "string"})]}, "tools[0].function.parameters", "describe an object"),
    ({"tools": [fn(parameters={"type": "object", "properties": []})]},
     "tools[0].function.parameters.properties", "mapping"),
    ({"tools": [fn(parameters={"type": "object", "required": "city"})]},
     "tools[0].function.parameters.required", "list of argument names"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "\"required\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "\"function\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": 3}}},
     "tool_choice.function.name", "string"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}},
     "tool_choice.function.name", "not among the tools (the tools are get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice.function.name",
     "no tools were given"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "tools=[{\"type\": \"function\""),
    ({"function_call": {"name": "f"}}, "function_call", "tool_choice"),
])
def test_bad_tool_requests_name_the_field(tokenizer, body, param, words):
    err = error_of(tokenizer, **body)
    assert err.param == param, err.message
    assert words in err.message
    assert err.code == "invalid_request_error"


def test_choices_and_their_defaults():
    assert tool_request.parse_tools({}) is None
    assert tool_request.parse_tools({"tools": [], "tool_choice": "auto", "function_call": "none"}) is None
    auto = tool_request.parse_tools({"tools": TOOLS})
    assert (auto.choice, auto.name, auto.parallel) == ("auto", None, True)
    assert auto.template_tools == TOOLS and auto.structured() is None and auto.extra_stop() == []
    none = tool_request.parse_tools({"tools": TOOLS, "tool_choice": "none"})
    assert none.template_tools is None and none.structured() is None
    named = tool_request.parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                               "parallel_tool_calls": False})
    assert (named.choice, named.name, named.parallel) == ("named", "get_time", False)
    assert named.structured_param() == "tools[1].function.parameters"
    assert tool_request.parse_tools({"tools": TOOLS, "parallel_tool_calls": False}).extra_stop() == [tool_parsers.TOOL_CALL_END]


def test_named_choice_constrains_to_the_function_parameters():
    named = tool_request.parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert named.structured() == {"type": "json_schema", "schema": WEATHER["function"]["parameters"]}
    bare = tool_request.parse_tools({"tools": [fn("ping")], "tool_choice": {"type": "function", "function": {"name": "ping"}}})
    assert bare.structured() == {"type": "json_schema", "schema": {"type": "object", "properties": {}}}


def test_required_choice_is_vllms_array_of_name_and_parameters():
    spec = tool_request.parse_tools({"tools": TOOLS, "tool_choice": "required"}).structured()
    assert spec == {"type": "json_schema", "schema": {
        "type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]}, "required": ["name", "parameters"], "additionalProperties": False},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": TIME["function"]["parameters"]}, "required": ["name", "parameters"], "additionalProperties": False},
        ]}}}
    single = tool_request.parse_tools({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert single.structured()["schema"]["maxItems"] == 1


def test_required_schema_moves_defs_to_the_root():
    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    with_defs = fn("plot", parameters={"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}},
                                        "$defs": {"Point": point}})
    same = fn("move", parameters={"type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}},
                                  "$defs": {"Point": point}})
    schema = tool_request.required_schema([with_defs, same])
    assert schema["$defs"] == {"Point": point}
    assert all("$defs" not in alt["properties"]["parameters"] for alt in schema["items"]["anyOf"])
    assert "$defs" in with_defs["function"]["parameters"]              # the request is not changed
    other = fn("jump", parameters={"type": "object", "$defs": {"Point": {"type": "string"}}})
    with pytest.raises(RequestError) as info:
        tool_request.required_schema([with_defs, other])
    assert info.value.param == "tools[1].function.parameters" and "Point" in info.value.message


def test_parse_request_sets_structured_and_stop(tokenizer):
    assert parse(tokenizer, tools=TOOLS).params.structured is None
    named = parse(tokenizer, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.params.structured == {"type": "json_schema", "schema": WEATHER["function"]["parameters"]}
    assert parse(tokenizer, tools=TOOLS, tool_choice="required").params.structured["schema"]["type"] == "array"
    single = parse(tokenizer, tools=TOOLS, parallel_tool_calls=False, stop="END")
    assert single.params.stop == ["END", "</tool_call>"] and single.params.structured is None


def test_a_tool_choice_constraint_does_not_combine_with_another():
    """The structured helper's response_format sets fields["structured"] first: refused by name."""
    named = tool_request.parse_tools({"tools": TOOLS, "tool_choice": "required"})
    fields = {"structured": {"type": "json_object"}}
    with pytest.raises(RequestError) as info:
        tool_request.sampling_fields(fields, named)
    assert info.value.param == "tool_choice" and "response_format" in info.value.message


# -- the chat template ------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 degrees"}]},
]


def rendered(tokenizer, **body) -> str:
    return tokenizer.decode(chat_prompt({"messages": HISTORY, **body}, tokenizer, MAX_LEN))


def test_tool_calls_and_results_go_through_the_template(tokenizer):
    text = rendered(tokenizer, tools=TOOLS)
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" + json.dumps(TIME) + "\n</tools>" in text
    assert text.count("<|im_start|>system\nBe brief.\n\n# Tools") == 1
    # The arguments reach the template as an object (tojson'd), not as the string they came in.
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 degrees\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_leaves_the_tools_out(tokenizer):
    text = rendered(tokenizer, tools=TOOLS, tool_choice="none")
    assert "<tools>" not in text and "<tool_response>" in text
    assert text == rendered(tokenizer)


def test_plain_chat_renders_as_before(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "V"}]
    ids = chat_prompt({"messages": messages}, tokenizer, MAX_LEN)
    assert tokenizer.decode(ids) == ("<|begin_of_text|><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU"
                                     "<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nV"
                                     "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "18"}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": 1, "content": "18"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": {"function": {"name": "f"}}}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": ["f"]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f"}}]},
     "messages[1].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{"id": 5, "function": {"name": "f"}}]}, "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": ""}}]}, "messages[1].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": "}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": "x", "name": 7}, "messages[1].name"),
])
def test_bad_tool_messages_name_the_field(tokenizer, message, param):
    with pytest.raises(RequestError) as info:
        chat_prompt({"messages": [*USER, message]}, tokenizer, MAX_LEN)
    assert info.value.param == param, info.value.message


def test_a_template_without_tools_refuses_them(tokenizer):
    plain = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}<|im_start|>assistant\n")     # SmolLM2-135M-Instruct's kind
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        with pytest.raises(RequestError) as info:
            parse_request(CHAT_COMPLETIONS, {"messages": USER, "tools": TOOLS, "tool_choice": choice}, plain, MAX_LEN)
        assert info.value.param == "tools" and "no tool support" in info.value.message
    # "none" leaves them out: nothing to refuse; tool messages still render through it.
    parse_request(CHAT_COMPLETIONS, {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"}, plain, MAX_LEN)


def test_tools_count_towards_the_prompt_size_check(tokenizer):
    big = fn("big", description="x" * 64 * 40)
    with pytest.raises(RequestError) as info:
        parse_request(CHAT_COMPLETIONS, {"messages": USER, "tools": [big]}, tokenizer, 40)
    assert info.value.code == "context_length_exceeded"


# -- Hermes parsing (auto) --------------------------------------------------------------------


def test_one_call_becomes_a_tool_call():
    content, calls = tool_parsers.parse_hermes(CALL, NAMES, "seed")
    assert content is None
    assert calls == [{"id": tool_parsers.call_id("seed", 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]
    assert calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29


def test_text_around_calls_is_the_content():
    text = f"Let me check.\n{CALL}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>\nDone."
    content, calls = tool_parsers.parse_hermes(text, NAMES, "s")
    assert content == "Let me check.\nDone."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}', "{}"]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("block", [
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par</tool_call>",   # bad JSON
    "<tool_call>\n{\"name\": \"get_news\", \"arguments\": {}}\n</tool_call>",                # unknown tool
    "<tool_call>\n[\"get_time\"]\n</tool_call>",                                          # not an object
    "<tool_call>\n{\"name\": \"get_time\", \"arguments\": [1]}\n</tool_call>",            # arguments not an object
])
def test_malformed_blocks_stay_in_the_content(block):
    text = f"Hmm. {block}"
    assert tool_parsers.parse_hermes(text, NAMES, "s") == (text, [])
    content, calls = tool_parsers.parse_hermes(f"{block}\n{CALL}", NAMES, "s")
    assert content == block and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_answers_without_calls_come_back_exactly():
    for text in ("", "  plain\n\n", "a <tool b", "x <tool_call", "<tool_call>\n{\"name\": \"get_time\", ",
                 "tail </tool_call> stray"):
        assert tool_parsers.parse_hermes(text, NAMES, "s") == (text, [])


def test_whitespace_around_calls_is_dropped():
    assert tool_parsers.parse_hermes(f"\n{CALL}\n\n{CALL}\n", NAMES, "s")[0] is None
    assert tool_parsers.parse_hermes(f"{CALL}\n After.\n", NAMES, "s")[0] == "After."
    assert tool_parsers.parse_hermes(f"Before. {CALL} {CALL}  after", NAMES, "s")[0] == "Before.  after"


def test_an_unclosed_complete_block_is_a_call():
    """The answer may end at the block's JSON (EOS, or the </tool_call> stop of parallel_tool_calls=false)."""
    content, calls = tool_parsers.parse_hermes('Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n', NAMES, "s")
    assert content == "Sure." and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_arguments_written_as_a_string_or_left_out():
    _, calls = tool_parsers.parse_hermes('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}'
                                  '</tool_call><tool_call>{"name": "get_time"}</tool_call>', NAMES, "s")
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}', "{}"]


STREAM_TEXTS = [
    f"Let me check.\n{CALL}\n<tool_call>\n{{\"name\": \"get_time\", \"arguments\": {{}}}}\n</tool_call>",
    f"<tool_call>oops</tool_call> then {CALL} and after\n",
    "no calls < here <tool_ at all\n",
    f"  {CALL}",
    f"{CALL}\n After.\n",
    f"Before. {CALL} {CALL}  after",
    '<tool_call>\n{"name": "get_time", "arguments": {}}',
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streamed_pieces_add_up_to_the_whole_answer(text):
    whole_content, whole_calls = tool_parsers.parse_hermes(text, NAMES, "s")
    for size in (1, 2, 3, 5, 8, 13, len(text) or 1):
        parser = tool_parsers.HermesParser(NAMES, "s")
        deltas = []
        for start in range(0, len(text), size):
            deltas += parser.feed(text[start:start + size])
        deltas += parser.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert (content or None if whole_calls else content) == whole_content, size
        assert [{k: c[k] for k in ("id", "type", "function")} for c in calls] == whole_calls, size
        assert [c["index"] for c in calls] == list(range(len(calls)))


# -- required answers -------------------------------------------------------------------------


def test_required_answers_become_calls():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'
    calls = tool_parsers.parse_required(text, NAMES, "s")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    cut = tool_parsers.parse_required(text[:70], NAMES, "s")          # cut inside the second element
    assert [c["function"]["name"] for c in cut] == ["get_weather"]
    assert tool_parsers.parse_required('[{"name": "get_wea', NAMES, "s") == []
    assert tool_parsers.parse_required("not json", NAMES, "s") == []


# -- response bodies --------------------------------------------------------------------------


def chat_body(text: str, finish: str = "stop", request_id: str = "job_1") -> dict:
    return build_response(CHAT_COMPLETIONS, request_id, "m", 5, text, [1] * 3, finish, None, None, None, created=1)


def test_auto_answers_get_tool_calls_and_finish_reason():
    body = tools.apply_tool_calls(chat_body(f"Checking.\n{CALL}"), {"messages": USER, "tools": TOOLS})
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["id"] == tool_parsers.call_id("chatcmpl-job_1:0", 0)
    cut = tools.apply_tool_calls(chat_body(CALL, "length"), {"messages": USER, "tools": TOOLS})
    assert cut["choices"][0]["finish_reason"] == "length" and cut["choices"][0]["message"]["content"] is None
    plain = tools.apply_tool_calls(chat_body("Just text."), {"messages": USER, "tools": TOOLS})
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Just text."}
    assert plain["choices"][0]["finish_reason"] == "stop"


def test_bodies_without_tools_or_with_none_are_untouched():
    for request in (None, {"messages": USER}, {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
                    {"messages": USER, "tools": "broken"}):
        assert tools.apply_tool_calls(chat_body(CALL), request) == chat_body(CALL)


def test_named_and_required_answers():
    named = {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    body = tools.apply_tool_calls(chat_body('{"city": "Lima"}'), named)
    [choice] = body["choices"]
    # OpenAI answers a named function with finish_reason "stop" (vllm-project/vllm#25054).
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": tool_parsers.call_id("chatcmpl-job_1:0", 0), "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]}
    cut = tools.apply_tool_calls(chat_body('{"city": "Li', "length"), named)["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Li'

    required = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    choice = tools.apply_tool_calls(chat_body('[{"name": "get_time", "parameters": {}}]'), required)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    broken = tools.apply_tool_calls(chat_body('[{"na', "length"), required)["choices"][0]
    assert broken["finish_reason"] == "length" and broken["message"] == {"role": "assistant", "content": '[{"na'}


def test_response_body_of_a_stored_job_parses_tool_calls():
    """What GET /v1/jobs/{id}, the synchronous endpoint and batch output lines return."""
    finished = datetime(2025, 1, 2, tzinfo=UTC)
    job = Job(id="job_abc", endpoint=CHAT_COMPLETIONS, model="m", prompt_tokens=9, finished_at=finished,
              params={"body": {"messages": USER, "tools": TOOLS}, "sampling": {}, "logprobs_mode": None})
    result = Result(job_id="job_abc", text=f"{CALL}\n", token_ids=[1, 2, 3], finish_reason="stop", logprobs=None)
    body = response_body(job, result)
    assert body["id"] == "chatcmpl-job_abc" and body["choices"][0]["finish_reason"] == "tool_calls"
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["id"] == tool_parsers.call_id("chatcmpl-job_abc:0", 0)
    assert response_body(job, result) == body                 # the same ids every time it is rebuilt
    job.params = {"body": {"messages": USER}}
    assert response_body(job, result)["choices"][0]["message"] == {"role": "assistant", "content": f"{CALL}\n"}


# -- stream chunks ----------------------------------------------------------------------------


def chunks_of(texts: list[str], finish: str, request_body: dict | None) -> list[dict]:
    async def events():
        for seq, text in enumerate(texts, start=1):
            data = {"seq": seq, "text": text, "token_ids": [seq]}
            if seq == len(texts):
                data |= {"finish_reason": finish, "usage": {"prompt_tokens": 3, "completion_tokens": len(texts)}}
            yield StreamEvent(seq, data)

    async def collect():
        out = []
        async for frame in openai_chunk_stream(events(), endpoint=CHAT_COMPLETIONS, job_id="job_s", model="m",
                                               prompt_tokens=3, include_usage=False, request_body=request_body):
            payload = frame.removeprefix("data: ").strip()
            if payload != "[DONE]":
                out.append(json.loads(payload))
        return out

    return asyncio.run(collect())


def deltas(chunks: list[dict]) -> list[dict]:
    return [c["choices"][0]["delta"] for c in chunks]


def test_auto_stream_holds_back_calls():
    pieces = ["Let me ", "check.\n<tool", "_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": ",
              "\"Paris\"}}\n</tool_call>", "\n"]
    chunks = chunks_of(pieces, "stop", {"messages": USER, "tools": TOOLS})
    assert deltas(chunks) == [
        {"role": "assistant", "content": ""},
        {"content": "Let me"},
        {"content": " check."},
        {"tool_calls": [{"index": 0, "id": tool_parsers.call_id("chatcmpl-job_s:0", 0), "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["tool_calls"]
    # The streamed call is the stored one (same id and arguments).
    stored = tools.apply_tool_calls(chat_body("".join(pieces), request_id="job_s"), {"messages": USER, "tools": TOOLS})
    assert stored["choices"][0]["message"]["tool_calls"][0] == {
        k: v for k, v in deltas(chunks)[3]["tool_calls"][0].items() if k != "index"}


def test_auto_stream_without_calls_is_plain_text():
    pieces = ["Hello", " <b>", "world\n"]
    chunks = chunks_of(pieces, "length", {"messages": USER, "tools": TOOLS})
    assert "".join(d.get("content", "") for d in deltas(chunks)) == "Hello <b>world\n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_named_stream_sends_the_arguments_as_they_come():
    named = {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    chunks = chunks_of(['{"city"', ': "Lima"', "}"], "stop", named)
    assert deltas(chunks)[1:] == [
        {"tool_calls": [{"index": 0, "id": tool_parsers.call_id("chatcmpl-job_s:0", 0), "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ': "Lima"'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_required_stream_sends_the_calls_at_the_end():
    required = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    chunks = chunks_of(['[{"name": "get_time", ', '"parameters": {}}]'], "stop", required)
    assert deltas(chunks)[1:] == [
        {"tool_calls": [{"index": 0, "id": tool_parsers.call_id("chatcmpl-job_s:0", 0), "type": "function",
                         "function": {"name": "get_time", "arguments": "{}"}}]},
        {},
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_stream_without_tools_is_unchanged():
    assert deltas(chunks_of(["a", "b"], "stop", {"messages": USER})) == [
        {"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]


# -- rein run-batch ---------------------------------------------------------------------------

# The grammar engine (rein.engine.structured) makes named/required answers valid JSON; without it
# (this branch alone) they are the model's free text, wrapped all the same.
STRUCTURED = importlib.util.find_spec("rein.engine.structured") is not None


@pytest.fixture(scope="module")
def engine(tiny_models):
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="64MiB", max_num_seqs=4,
                                  max_model_len=1024))


def test_run_batch_lines_with_tools(engine, tmp_path):
    from rein.offline.run_batch import run_batch

    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = {
        "auto": {"messages": HISTORY, "tools": TOOLS, "max_tokens": 6, "temperature": 0},
        "named": {"messages": USER, "tools": TOOLS, "tool_choice": named, "max_tokens": 24, "temperature": 0},
        "required": {"messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24,
                     "temperature": 0},
        "single": {"messages": USER, "tools": TOOLS, "parallel_tool_calls": False, "max_tokens": 6},
        "bad": {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    }
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": CHAT_COMPLETIONS, "body": body})
                           + "\n" for cid, body in bodies.items()))
    summary = run_batch(engine, src, out, progress=False)
    assert (summary.requests_ok, summary.requests_failed) == (4, 1)
    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert lines["bad"]["error"]["code"] == "invalid_request_error"
    assert lines["bad"]["error"]["message"].startswith("line 5: tool_choice names the function 'nope'")

    bodies_out = {cid: lines[cid]["response"]["body"] for cid in ("auto", "named", "required", "single")}
    for body in bodies_out.values():
        assert body["object"] == "chat.completion" and body["usage"]["prompt_tokens"] > 0
    [choice] = bodies_out["named"]["choices"]
    assert choice["message"]["content"] is None and choice["finish_reason"] in ("stop", "length")
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"] == tool_parsers.call_id(bodies_out["named"]["id"] + ":0", 0)
    if STRUCTURED and choice["finish_reason"] == "stop":
        assert isinstance(json.loads(call["function"]["arguments"]), dict)
    required = bodies_out["required"]["choices"][0]
    if STRUCTURED and required["finish_reason"] != "length":
        assert required["finish_reason"] == "tool_calls" and required["message"]["tool_calls"]


def test_each_choice_of_an_n_stream_has_its_own_tool_stream():
    """n = 2, interleaved: choice 1 calls a tool, choice 0 answers in text; each choice's
    deltas and finish_reason are its own, and call ids follow the choice index."""
    texts = [(0, "Sunny"), (1, CALL[:20]), (0, " today."), (1, CALL[20:])]

    async def events():
        for seq, (index, text) in enumerate(texts, start=1):
            data = {"seq": seq, "text": text, "token_ids": [seq], "index": index}
            if seq == 3:
                data["choice_finish_reason"] = "stop"
            if seq == len(texts):
                data |= {"finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 4}}
            yield StreamEvent(seq, data)

    async def collect():
        out = []
        async for frame in openai_chunk_stream(events(), endpoint=CHAT_COMPLETIONS, job_id="job_n", model="m",
                                               prompt_tokens=3, include_usage=False, n=2,
                                               request_body={"messages": USER, "tools": TOOLS}):
            payload = frame.removeprefix("data: ").strip()
            if payload != "[DONE]":
                out.append(json.loads(payload)["choices"][0])
        return out

    chunks = asyncio.run(collect())
    by_index = {i: [c for c in chunks if c["index"] == i] for i in (0, 1)}
    assert "".join(c["delta"].get("content") or "" for c in by_index[0]) == "Sunny today."
    assert [c["finish_reason"] for c in by_index[0] if c["finish_reason"]] == ["stop"]
    calls = [tc for c in by_index[1] for tc in c["delta"].get("tool_calls", [])]
    assert [(tc["id"], tc["function"]["name"]) for tc in calls] == [
        (tool_parsers.call_id("chatcmpl-job_n:1", 0), "get_weather")]
    assert [c["finish_reason"] for c in by_index[1] if c["finish_reason"]] == ["tool_calls"]


def test_output_nested_past_the_recursion_limit_stays_content():
    """A model's 'call' nested 100,000 deep raised RecursionError (a 500 on GET, a batch stuck
    in finalizing); it is text that is not a call, like any other malformed block."""
    deep = "[" * 100_000 + "]" * 100_000
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": ' + deep + "}}</tool_call>"
    assert tool_parsers.parse_hermes(block, NAMES, "s") == (block, [])
    content, calls = tool_parsers.parse_hermes(f"{block}\n{CALL}", NAMES, "s")
    assert content == block and len(calls) == 1
    required = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": ' + deep + "}]"
    assert [c["function"]["name"] for c in tool_parsers.parse_required(required, NAMES, "s")] == ["get_time"]
