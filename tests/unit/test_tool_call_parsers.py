"""The auto-mode tool call formats (rein.openai.tool_call_parsers, tool_parsers_json,
tool_parser_qwen3_coder): each format's calls, content around them, malformed and unknown calls
kept as content, streamed pieces adding up to the whole answer, the format chosen from a chat
template, and the choice reaching parse_request, response bodies, stream chunks and stored jobs."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pytest

from rein.api.streams import StreamEvent, openai_chunk_stream
from rein.core.settings import SettingsError, load_engine_settings
from rein.jobs.results import response_body
from rein.openai import tool_call_parsers
from rein.openai.endpoints import CHAT_COMPLETIONS
from rein.openai.request import parse_request
from rein.openai.response import build_response
from rein.openai.tool_parser_qwen3_coder import convert_value
from rein.openai.tool_parsers import call_id, parse_whole
from rein.openai.tools import apply_tool_calls
from rein.store.tables import Job, Result

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "where": {"type": "object"}, "ratio": {"type": "number"},
        "note": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
NAMES = frozenset({"get_weather", "get_time"})
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def whole(parser: str, text: str):
    return parse_whole(tool_call_parsers.new_parser(parser, NAMES, "s", PARAMETERS), text)


def calls_of(parser: str, text: str) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole(parser, text)[1]]


# -- llama3_json ------------------------------------------------------------------------------


def test_llama3_json_calls():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    content, calls = whole("llama3_json", text)
    assert content is None
    assert calls == [{"id": call_id("s", 0), "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    several = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "arguments": {}}'
    assert calls_of("llama3_json", several) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert whole("llama3_json", several)[0] is None
    # text after the calls is content
    assert whole("llama3_json", '\n{"name": "get_time", "parameters": {}}\nThat is all.') == (
        "That is all.", [{"id": call_id("s", 0), "type": "function", "function": {"name": "get_time", "arguments": "{}"}}])


@pytest.mark.parametrize("text", [
    "The weather is fine.",                                            # plain text
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}',   # a call not at the start
    '{"name": "get_news", "parameters": {}}',                           # unknown function
    '{"name": "get_weather", "parameters": {"city": "Par',              # cut short
    '<|python_tag|>{"name": "get_weather", "parameters": [1]}',         # parameters not an object
    '{"city": "Paris"}',                                                # no name
    "  <|python_t",
    "{not json}",
])
def test_llama3_json_non_calls_stay_content(text):
    assert whole("llama3_json", text) == (text, [])


def test_llama3_json_a_bad_call_after_a_good_one_is_content():
    text = '{"name": "get_time", "parameters": {}}; {"name": "nope", "parameters": {}}'
    content, calls = whole("llama3_json", text)
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    assert content == '{"name": "nope", "parameters": {}}'


# -- mistral ----------------------------------------------------------------------------------


def test_mistral_array_form():
    text = 'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": "{}"}]'
    content, calls = whole("mistral", text)
    assert content == "Checking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Rome"}'), ("get_time", "{}")]
    assert [c["id"] for c in calls] == [call_id("s", 0), call_id("s", 1)]


def test_mistral_name_args_form():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 2}[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}'
    assert calls_of("mistral", text) == [("get_weather", {"city": "Lima", "days": 2}), ("get_time", {})]
    assert whole("mistral", text)[0] is None


@pytest.mark.parametrize("text", [
    "no calls [TOOL but a partial tag",
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "nope", "arguments": {}}]',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro',
    '[TOOL_CALLS]get_news[ARGS]{}',
    '[TOOL_CALLS]get_weather[ARGS]["x"]',
    '[TOOL_CALLS]get_weather[ARGS]nope',
    '[TOOL_CALLS]' + "x" * 300,
    "[TOOL_CALLS][]",
])
def test_mistral_non_calls_stay_content(text):
    assert whole("mistral", text) == (text, [])


# -- qwen3_coder ------------------------------------------------------------------------------

QWEN_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
             "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n"
             "<parameter=ratio>\n0.5\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
             "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_values_follow_the_schema():
    content, calls = whole("qwen3_coder", f"Let me look.\n{QWEN_CALL}\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "metric": False, "hours": [1, 2], "where": {"lat": 1.5},
                         "ratio": 0.5, "note": None, "extra": "7"}),
        ("get_time", {})]


def test_qwen3_coder_value_conversion():
    assert convert_value("12", {"type": "integer"}) == 12
    assert convert_value("twelve", {"type": "integer"}) == "twelve"      # does not convert: the string
    assert convert_value("2", {"type": "number"}) == 2 and convert_value("2.5e1", {"type": "number"}) == 25.0
    assert convert_value("nan", {"type": "number"}) == "nan"
    assert convert_value("True", {"type": "boolean"}) is True
    assert convert_value("null", {"type": "integer"}) is None
    assert convert_value("null", {"type": "string"}) == "null"
    assert convert_value(" multi\nline ", {"type": "string"}) == " multi\nline "
    assert convert_value("[1]", {"type": "object"}) == "[1]"
    assert convert_value("5", {"type": ["integer", "string"]}) == 5
    assert convert_value("5", None) == "5"


@pytest.mark.parametrize("block", [
    "<tool_call>\n<function=get_news>\n</function>\n</tool_call>",                        # unknown function
    "<tool_call>\n<function=get_time>\n</tool_call>",                                    # no </function>
    "<tool_call>\n<function=get_weather>\nstray<parameter=city>\nX\n</parameter>\n</function>\n</tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',                   # Hermes JSON
])
def test_qwen3_coder_malformed_blocks_stay_content(block):
    assert whole("qwen3_coder", f"Hmm. {block}") == (f"Hmm. {block}", [])


# -- streams agree with whole answers ---------------------------------------------------------

STREAMS = {
    "llama3_json": [
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "O\\"slo}"}}; {"name": "get_time", "parameters": {}}',
        '  {"name": "get_time", "parameters": {}} ; \n after',
        '{"name": "get_time", "parameters": {}};',
        "plain { text }",
        '{"name": "nope", "parameters": {}}',
        '<|python_tag|>{"name": "get_time", "parameters": {',
    ],
    "mistral": [
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "R]o}me"}}] done',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]get_time[ARGS]{}',
        "[TOOL_CALLS]get_news[ARGS]{} then [TOOL_CALLS]get_time[ARGS]{}",
        "text [TOOL_CALL",
    ],
    "qwen3_coder": [
        f"Before. {QWEN_CALL} after\n",
        f"{QWEN_CALL}\n{QWEN_CALL}",
        "<tool_call>\n<function=get_time>\n</function>\n",
        "<tool_call>\n<function=nope>\n</function>\n</tool_call>",
    ],
}


@pytest.mark.parametrize("parser,text", [(p, t) for p, texts in STREAMS.items() for t in texts])
def test_streamed_pieces_add_up_to_the_whole_answer(parser, text):
    whole_content, whole_calls = whole(parser, text)
    for size in (1, 2, 3, 5, 8, 13, len(text)):
        machine = tool_call_parsers.new_parser(parser, NAMES, "s", PARAMETERS)
        deltas = []
        for start in range(0, len(text), size):
            deltas += machine.feed(text[start:start + size])
        deltas += machine.finish()
        content = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert (content or None if whole_calls else content) == whole_content, size
        assert [{k: c[k] for k in ("id", "type", "function")} for c in calls] == whole_calls, size
        assert [c["index"] for c in calls] == list(range(len(calls)))


# -- choosing a format ------------------------------------------------------------------------


@pytest.mark.parametrize("template,parser", [
    ("{% for m in messages %}<tool_call>\n<function={{ t.name }}>\n{% endfor %}", "qwen3_coder"),
    ("{{ '[AVAILABLE_TOOLS]' }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}", "mistral"),
    ("{% if builtin_tools %}<|python_tag|>{% endif %}", "llama3_json"),
    ("{% if message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>{% endif %}", "llama3_json"),
    ("<tool_call>\n{\"name\": ...}\n</tool_call>", "hermes"),
    ("{{ messages[0].content }}", "hermes"),
    (None, "hermes"),
    ({"default": "x", "tool_use": "[TOOL_CALLS]"}, "mistral"),
])
def test_the_format_comes_from_the_chat_template(template, parser):
    assert tool_call_parsers.detect_tool_call_parser(template) == parser


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, qwen3_coder"):
        tool_call_parsers.check_tool_call_parser("pythonic")
    with pytest.raises(SettingsError, match="REIN_TOOL_CALL_PARSER"):
        load_engine_settings(tool_call_parser="pythonic")
    assert load_engine_settings(tool_call_parser="mistral").tool_call_parser == "mistral"


def test_the_parser_reaches_sampling(tokenizer):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "parallel_tool_calls": False}
    hermes = parse_request(CHAT_COMPLETIONS, body, tokenizer, 2048)
    assert hermes.params.stop == ["</tool_call>"] and hermes.params.skip_special_tokens
    llama = parse_request(CHAT_COMPLETIONS, body, tokenizer, 2048, tool_parser="llama3_json")
    assert llama.params.stop == []
    mistral = parse_request(CHAT_COMPLETIONS, body, tokenizer, 2048, tool_parser="mistral")
    assert not mistral.params.skip_special_tokens        # [TOOL_CALLS] is a special token
    kept = parse_request(CHAT_COMPLETIONS, {**body, "skip_special_tokens": True}, tokenizer, 2048,
                         tool_parser="mistral")
    assert kept.params.skip_special_tokens


LLAMA_ANSWER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def _body(text: str) -> dict:
    return build_response(CHAT_COMPLETIONS, "j1", "m", 3, text, [1, 2], "stop", None, None, None, created=0)


def test_bodies_and_stored_jobs_use_the_stored_parser():
    request = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    hermes = apply_tool_calls(_body(LLAMA_ANSWER), request)
    assert hermes["choices"][0]["message"]["content"] == LLAMA_ANSWER      # not a Hermes call
    llama = apply_tool_calls(_body(LLAMA_ANSWER), request, "llama3_json")
    assert llama["choices"][0]["message"]["content"] is None
    assert llama["choices"][0]["finish_reason"] == "tool_calls"
    assert llama["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

    now = datetime.now(UTC)
    job = Job(id="j1", endpoint=CHAT_COMPLETIONS, model="m", prompt_tokens=3, finished_at=now,
              params={"body": request, "tool_parser": "llama3_json"})
    result = Result(job_id="j1", text=LLAMA_ANSWER, token_ids=[1, 2], finish_reason="stop", logprobs=None, created_at=now)
    stored = response_body(job, result)
    assert stored["choices"][0]["message"]["tool_calls"] == llama["choices"][0]["message"]["tool_calls"]
    job.params = {"body": request}        # stored before the setting existed: hermes
    assert response_body(job, result)["choices"][0]["message"]["content"] == LLAMA_ANSWER


def test_stream_chunks_use_the_parser():
    async def events():
        pieces = (LLAMA_ANSWER[:10], LLAMA_ANSWER[10:])
        for seq, piece in enumerate(pieces, start=1):
            data = {"seq": seq, "text": piece, "token_ids": [seq]}
            if seq == len(pieces):
                data |= {"finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
            yield StreamEvent(seq, data)

    async def collect():
        return [c async for c in openai_chunk_stream(
            events(), endpoint=CHAT_COMPLETIONS, job_id="j1", model="m", prompt_tokens=3, include_usage=False,
            request_body={"messages": [], "tools": TOOLS}, tool_parser="llama3_json")]

    chunks = [json.loads(c.removeprefix("data: ")) for c in asyncio.run(collect()) if "[DONE]" not in c]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert not any(d.get("content") for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
