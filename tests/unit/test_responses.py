"""The Responses API on chat (rein.openai.responses, responses_body, responses_stream,
rein.api.responses_sse): a Responses request as the chat body it runs as, the refusals, a
finished chat body as a `response` object (stored jobs included), and the streamed events,
each checked against the official `openai` SDK's own types."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from rein.api.responses_sse import responses_event_stream
from rein.api.streams import StreamEvent
from rein.jobs.results import response_body
from rein.openai.endpoints import CHAT_COMPLETIONS, RESPONSES
from rein.openai.errors import RequestError
from rein.openai.request import parse_request
from rein.openai.responses import chat_body, parse_responses_request, responses_error
from rein.openai.responses_body import response_from_chat
from rein.openai.responses_stream import ResponsesStream
from rein.openai.tools import apply_tool_calls
from rein.store.tables import Job, Result

MAX_LEN = 2048
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
STREAM_EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def refusal(**body) -> RequestError:
    with pytest.raises(RequestError) as caught:
        chat_body({"input": "hi", **body})
    return caught.value


# -- request -> chat body -----------------------------------------------------------------------


def test_string_input_and_instructions():
    chat = chat_body({"model": "m", "input": "Hello", "instructions": "Be brief.", "max_output_tokens": 7,
                      "temperature": 0.0, "top_p": 0.5, "metadata": {"k": "v"}, "store": False})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Hello"}],
                    "max_tokens": 7, "temperature": 0.0, "top_p": 0.5}


def test_item_input_messages_parts_and_tool_turns():
    chat = chat_body({"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ], "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": True})
    assert chat["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER["parameters"],
        "strict": True}}]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True


def test_function_call_without_text_is_its_own_assistant_turn():
    chat = chat_body({"input": [{"role": "user", "content": "hi"},
                                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]})
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_text_format_tool_choice_and_stream():
    chat = chat_body({"input": "x", "stream": True, "tools": [WEATHER],
                      "tool_choice": {"type": "function", "name": "get_weather"},
                      "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}})
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert chat_body({"input": "x", "text": {"format": {"type": "json_object"}}})["response_format"] == \
        {"type": "json_object"}
    assert chat_body({"input": "x", "text": {"format": {"type": "text"}}})["response_format"] == {"type": "text"}


def test_the_chat_body_parses_with_the_template(tokenizer):
    """The translated body is a valid chat request: the prompt is what chat would render."""
    body = {"input": [{"role": "user", "content": "Weather?"}], "instructions": "Be brief.", "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 9}
    parsed = parse_request(CHAT_COMPLETIONS, chat_body(body), tokenizer, MAX_LEN)
    assert parsed.params.max_tokens == 9
    assert parsed.params.structured is not None     # the named function's schema constrains the output
    same = parse_request(CHAT_COMPLETIONS, {"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Weather?"}],
                                            "tools": [{"type": "function", "function": {
                                                k: v for k, v in WEATHER.items() if k != "type"}}],
                                            "tool_choice": "none"}, tokenizer, MAX_LEN)
    plain = parse_request(CHAT_COMPLETIONS, chat_body({**body, "tool_choice": "none"}), tokenizer, MAX_LEN)
    assert plain.prompt_token_ids == same.prompt_token_ids


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "send the earlier turns in `input`"),
    ({"conversation": "conv_1"}, "conversation", "stores no conversations"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "stores no prompt templates"),
    ({"background": True}, "background", "POST /v1/jobs"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "runs no built-in tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "leave include out"),
    ({"truncation": "auto"}, "truncation", "never drops"),
    ({"top_logprobs": 3}, "top_logprobs", "/v1/chat/completions"),
    ({"max_tool_calls": 2}, "max_tool_calls", "leave it out"),
    ({"frobnicate": 1}, "frobnicate", "Unrecognized request argument"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input[0].content[0].type", "input_image parts"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stores no items"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user, system, developer or assistant"),
    ({"input": []}, "input", "non-empty list"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "extra": 1}}}, "text.format", "extra"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "minimal"),
    ({"metadata": {"k": 1}}, "metadata", "strings"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"store": "no"}, "store", "boolean"),
])
def test_refusals_name_the_field_and_what_to_do(body, param, words):
    error = refusal(**body)
    assert error.param == param
    assert words in error.message


def test_accepted_without_effect():
    chat = chat_body({"input": "x", "reasoning": {"effort": "high", "summary": "auto"}, "store": True,
                      "truncation": "disabled", "include": [], "background": False, "user": "u",
                      "previous_response_id": None})
    assert "reasoning" not in chat and chat["user"] == "u"


def test_chat_errors_name_the_responses_fields():
    error = responses_error(RequestError("response_format.json_schema.name is required", "response_format.json_schema.name"))
    assert error.param == "text.format.name" and error.message == "text.format.name is required"
    assert responses_error(RequestError("max_tokens must be at least 1", "max_tokens")).param == "max_output_tokens"


# -- chat body -> response -------------------------------------------------------------------


def chat_completion(content, finish="stop", tool_calls=None, reasoning=None, usage=None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": "chatcmpl-job_1", "object": "chat.completion", "created": 1700000000, "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage or {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                               "prompt_tokens_details": {"cached_tokens": 2}}}


def test_plain_answer_as_a_response():
    request = {"model": "m", "input": "hi", "metadata": {"k": "v"}, "temperature": 0.0}
    body = response_from_chat(chat_completion("Hello."), request, "job_1")
    parsed = Response.model_validate(body)
    assert parsed.id == "resp_job_1" and parsed.status == "completed" and parsed.output_text == "Hello."
    assert parsed.metadata == {"k": "v"} and parsed.temperature == 0.0 and parsed.incomplete_details is None
    assert body["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 8}
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"


def test_length_is_incomplete():
    body = response_from_chat(chat_completion("Hel", finish="length"), {"input": "hi"}, "job_1")
    parsed = Response.model_validate(body)
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert body["output"][0]["status"] == "incomplete"


def test_reasoning_and_tool_calls_as_items():
    calls = [{"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"P"}'}}]
    usage = {"prompt_tokens": 5, "completion_tokens": 9, "completion_tokens_details": {"reasoning_tokens": 4}}
    request = {"input": "hi", "tools": [WEATHER], "reasoning": {"effort": "low", "summary": "auto"}}
    body = response_from_chat(chat_completion(None, "tool_calls", calls, "Let me think.", usage), request, "job_1")
    parsed = Response.model_validate(body)
    reasoning, call = parsed.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me think."
    assert reasoning.summary[0].text == "Let me think."       # a summary asked: the reasoning text itself
    assert call.type == "function_call" and call.call_id == "call_abc" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "P"}
    assert parsed.usage.output_tokens_details.reasoning_tokens == 4
    assert parsed.tools[0].name == "get_weather" and parsed.reasoning.effort == "low"


def test_stored_job_body_is_the_response_and_stable():
    """What GET /v1/jobs/{id}, the synchronous endpoint and batch output lines return."""
    request = {"input": "Weather?", "tools": [WEATHER], "metadata": {"a": "b"}}
    job = Job(id="job_abc", endpoint=RESPONSES, model="m", prompt_tokens=9, created_at=datetime(2025, 1, 1, tzinfo=UTC),
              finished_at=datetime(2025, 1, 2, tzinfo=UTC), params={"body": request, "sampling": {}})
    result = Result(job_id="job_abc", text=f"{CALL}\n", token_ids=[1, 2, 3], finish_reason="stop", logprobs=None)
    body = response_body(job, result, cached_tokens=1)
    parsed = Response.model_validate(body)
    assert parsed.id == "resp_job_abc" and parsed.created_at == datetime(2025, 1, 1, tzinfo=UTC).timestamp()
    assert parsed.completed_at == datetime(2025, 1, 2, tzinfo=UTC).timestamp()
    [call] = parsed.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert parsed.usage.input_tokens == 9 and parsed.usage.output_tokens == 3
    assert parsed.usage.input_tokens_details.cached_tokens == 1 and parsed.metadata == {"a": "b"}
    assert response_body(job, result, cached_tokens=1) == body


# -- streamed events --------------------------------------------------------------------------


def stream_events(texts: list[str], finish: str, request: dict, error: str | None = None) -> list[dict]:
    async def events():
        for seq, text in enumerate(texts, start=1):
            data = {"seq": seq, "text": text, "token_ids": [seq]}
            if seq == len(texts):
                if error:
                    data = {"seq": seq, "error": error, "code": "job_failed"}
                else:
                    data |= {"finish_reason": finish, "usage": {"prompt_tokens": 3, "completion_tokens": len(texts),
                                                                "total_tokens": 3 + len(texts)}}
            yield StreamEvent(seq, data)

    async def collect():
        return [line async for line in responses_event_stream(events(), job_id="job_1", model="m",
                                                               prompt_tokens=3, request_body=request)]

    out = []
    for line in asyncio.run(collect()):
        head, data = line.rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        STREAM_EVENTS.validate_python(event)    # the SDK's own type of each event
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def test_stream_of_text():
    events = stream_events(["Hel", "lo", "."], "stop", {"input": "hi"})
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.completed"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Hello."
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello." and final.status == "completed" and final.usage.output_tokens == 3
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_stream_cut_by_length_is_incomplete():
    events = stream_events(["Hel"], "length", {"input": "hi", "max_output_tokens": 1})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_stream_of_a_named_tool_call():
    request = {"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    events = stream_events(['{"city": ', '"Paris"}'], "stop", request)
    types = [e["type"] for e in events]
    assert "response.output_text.delta" not in types
    assert types.count("response.function_call_arguments.delta") == 2
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    final = Response.model_validate(events[-1]["response"])
    [call] = final.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == done["arguments"]


def test_stream_of_an_auto_tool_call_after_text():
    events = stream_events(["Sure. ", CALL[:20], CALL[20:]], "stop", {"input": "hi", "tools": [WEATHER]})
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}


def test_stream_matches_the_non_streamed_body():
    request = {"input": "hi", "tools": [WEATHER]}
    job = Job(id="job_1", endpoint=RESPONSES, model="m", prompt_tokens=3,
              finished_at=datetime(2025, 1, 2, tzinfo=UTC), params={"body": request})
    texts = ["Sure. ", CALL]
    stored = response_body(job, Result(job_id="job_1", text="".join(texts), token_ids=[1, 2], finish_reason="stop",
                                       logprobs=None))
    streamed = stream_events(texts, "stop", request)[-1]["response"]
    assert streamed["output"] == stored["output"]
    assert {k: v for k, v in streamed["usage"].items()} == stored["usage"]


def test_stream_error_is_response_failed():
    events = stream_events(["Hel", "x"], "stop", {"input": "hi"}, error="the worker died")
    assert events[-1]["type"] == "response.failed"
    assert "the worker died" in events[-1]["response"]["error"]["message"]


def test_reasoning_deltas_become_a_reasoning_item():
    """A chat stream with reasoning_content deltas (a model with a reasoning parser)."""
    stream = ResponsesStream({"input": "hi", "reasoning": {"summary": "auto"}}, "job_1", "m", 0)
    events = stream.start()
    for delta in ({"reasoning_content": "Think"}, {"reasoning_content": "ing."}, {"content": "Yes."}):
        events += stream.feed({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    events += stream.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    events += stream.finish()
    for event in events:
        STREAM_EVENTS.validate_python(event)
    types = [e["type"] for e in events]
    assert types.count("response.reasoning_text.delta") == 2 and "response.reasoning_summary_text.done" in types
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Thinking." and final.output_text == "Yes."
    stored = response_from_chat(chat_completion("Yes.", reasoning="Thinking."), stream.request, "job_1")
    assert events[-1]["response"]["output"] == stored["output"]


def test_apply_tool_calls_leaves_a_response_alone():
    body = response_from_chat(chat_completion("x"), {"input": "hi"}, "job_1")
    assert apply_tool_calls(body, chat_body({"input": "hi", "tools": [WEATHER]})) is body


# -- offline run-batch ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models):
    from rein.engine.config import EngineConfig
    from rein.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(tiny_models("llama")), kv_cache_memory="64MiB", max_num_seqs=4,
                                  max_model_len=1024))


def test_run_batch_lines_of_responses(engine, tmp_path):
    """`rein run-batch` with /v1/responses lines: Responses bodies out, bad lines answered with
    the Responses field named; a chat line in the same file is unchanged."""
    from rein.offline.run_batch import run_batch

    named = {"type": "function", "name": "get_weather"}
    lines = [
        ("plain", RESPONSES, {"input": "Name a river.", "max_output_tokens": 5, "temperature": 0}),
        ("tool", RESPONSES, {"input": "Weather?", "tools": [WEATHER], "tool_choice": named, "max_output_tokens": 24}),
        ("stateful", RESPONSES, {"input": "hi", "previous_response_id": "resp_1"}),
        ("chat", CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) + "\n"
                           for cid, url, body in lines))
    summary = run_batch(engine, src, out, progress=False)
    assert (summary.requests_ok, summary.requests_failed) == (3, 1)
    answered = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert "previous_response_id" in answered["stateful"]["error"]["message"]
    plain = Response.model_validate(answered["plain"]["response"]["body"])
    assert plain.object == "response" and 0 < plain.usage.output_tokens <= 5
    assert plain.status in ("completed", "incomplete") and isinstance(plain.output_text, str)
    tool = Response.model_validate(answered["tool"]["response"]["body"])
    [call] = tool.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert answered["chat"]["response"]["body"]["object"] == "chat.completion"


# -- any body: a 400 or a chat body, never a crash -------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-1, 3) | st.sampled_from(
    ["", "x", "message", "function_call", "function_call_output", "reasoning", "input_text", "user", "assistant",
     "function", "json_schema", "auto", "none", "required", "get_weather"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "role", "content", "text", "name", "call_id", "arguments", "output", "format", "schema",
         "parameters", "effort", "summary", "k"]), children, max_size=4), max_leaves=12)
FIELDS = st.sampled_from(["input", "instructions", "text", "tools", "tool_choice", "reasoning", "metadata",
                          "max_output_tokens", "store", "include", "truncation", "stream_options", "background"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(FIELDS, JSON, max_size=4))
def test_any_body_is_refused_cleanly_or_parses(tokenizer, body):
    try:
        parse_responses_request({"input": "hi", **body}, tokenizer, MAX_LEN)
    except RequestError as error:
        assert error.message and (error.param is None or isinstance(error.param, str))
