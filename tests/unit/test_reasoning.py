"""Reasoning parsers (rein.openai.reasoning): the split of a finished answer, the streamed split
(which must agree with it whatever the deltas), the reasoning token count, and how a chat request
to a reasoning model is parsed (the template's enable_thinking, the structured output's wait for
the end of the thinking)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rein.openai.reasoning import (
    PARSERS,
    ModelReasoning,
    Reasoning,
    ReasoningParserError,
    ReasoningStream,
    apply_reasoning,
    check_parser_names,
    parsers_by_model,
    reasoning_parser,
    reasoning_token_count,
    split_reasoning,
)
from rein.openai.request import parse_request

START, END = 7, 8   # token ids of <think> and </think> in the token-count cases

R1 = Reasoning("deepseek_r1", START, END)
QWEN3 = Reasoning("qwen3", START, END)

CASES = {
    # text: (deepseek_r1's split, qwen3's split)
    "I think so.</think>\n\nYes.": (("I think so.", "\n\nYes."), (None, "I think so.</think>\n\nYes.")),
    "<think>\nhmm</think>Yes.": (("\nhmm", "Yes."), ("\nhmm", "Yes.")),
    "\n<think>a < b</think>": (("a < b", None), ("a < b", None)),
    "still thinking <th": (("still thinking <th", None), (None, "still thinking <th")),
    "<think>never closed": (("never closed", None), ("never closed", None)),
    "Just an answer.": (("Just an answer.", None), (None, "Just an answer.")),
    "a</think>b</think>c": (("a", "b</think>c"), (None, "a</think>b</think>c")),
    "<think></think>{\"a\": 1}": ((None, "{\"a\": 1}"), (None, "{\"a\": 1}")),
    "x<think>y</think>z": (("x<think>y", "z"), (None, "x<think>y</think>z")),
    "": ((None, ""), (None, "")),
    "  ": (("  ", None), (None, "  ")),
}


@pytest.mark.parametrize("text", list(CASES))
def test_split_of_a_whole_answer(text):
    r1, qwen3 = CASES[text]
    assert split_reasoning(R1, text) == r1
    assert split_reasoning(QWEN3, text) == qwen3


def test_a_prompt_that_closed_the_thinking_leaves_all_content():
    ended = Reasoning("deepseek_r1", START, END, ended_in_prompt=True)
    assert split_reasoning(ended, "no thinking</think>here") == (None, "no thinking</think>here")
    assert reasoning_token_count(ended, [1, 2, END, 3]) == 0
    model = ModelReasoning(reasoning_parser("qwen3"), START, END)
    assert model.for_prompt([1, START, 2, 2, END, 2]).ended_in_prompt            # enable_thinking: false
    assert not model.for_prompt([1, START, 2]).ended_in_prompt                    # the template opened it
    assert not model.for_prompt([1, 2, 3]).ended_in_prompt
    assert not model.for_prompt([1, START, 2, END, 5, START]).ended_in_prompt      # the last tag decides


def stream(reasoning: Reasoning, deltas: list[str]) -> tuple[list[dict[str, str]], str, str]:
    splitter = ReasoningStream(reasoning)
    out = []
    for delta in deltas:
        out.extend(splitter.feed(delta))
    out.extend(splitter.finish())
    thinking = "".join(d.get("reasoning_content", "") for d in out)
    content = "".join(d.get("content", "") for d in out)
    return out, thinking, content


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("reasoning", [R1, QWEN3, Reasoning("qwen3", START, END, True)], ids=["r1", "qwen3", "ended"])
@pytest.mark.parametrize("text", list(CASES))
def test_streamed_split_agrees_with_the_whole_whatever_the_deltas(reasoning, text):
    thinking, content = split_reasoning(reasoning, text)
    rng = random.Random(text)
    splits = [list(text), [text], *(pieces(text, rng) for _ in range(30))]
    for deltas in splits:
        out, got_thinking, got_content = stream(reasoning, deltas)
        assert (got_thinking, got_content) == (thinking or "", content or ""), deltas
        assert all(d and all(v for v in d.values()) for d in out)   # no empty deltas


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "</th", "think>", "k>", " ", "\n", "a",
                                       "{}", "<thi", "nk"]), max_size=12),
       cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=6),
       parser=st.sampled_from(["deepseek_r1", "qwen3"]), ended=st.booleans())
def test_streamed_split_agrees_with_the_whole_on_any_text(parts, cuts, parser, ended):
    text = "".join(parts)
    reasoning = Reasoning(parser, START, END, ended)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    thinking, content = split_reasoning(reasoning, text)
    out, got_thinking, got_content = stream(reasoning, deltas)
    assert (got_thinking, got_content) == (thinking or "", content or "")
    shown = ""
    for delta in out:                       # no reasoning delta ever shows part of an end tag it later completes
        shown += delta.get("reasoning_content", "")
    assert "</think>" not in shown


def test_a_tag_split_across_deltas_is_held_back_never_shown_in_part():
    splitter = ReasoningStream(R1)
    assert splitter.feed("Let me see <") == [{"reasoning_content": "Let me see "}]
    assert splitter.feed("/thi") == []                                  # could still be </think>
    assert splitter.feed("nk>") == []                                   # it was: nothing after it yet
    assert splitter.feed("{}") == [{"content": "{}"}]
    splitter = ReasoningStream(R1)
    assert splitter.feed("a </th") == [{"reasoning_content": "a "}]
    assert splitter.feed("e") == [{"reasoning_content": "</the"}]        # not a tag after all
    qwen = ReasoningStream(QWEN3)
    assert qwen.feed("\n<thi") == []                                    # may yet open the thinking
    assert qwen.feed("nk>x") == [{"reasoning_content": "x"}]
    qwen = ReasoningStream(QWEN3)
    assert qwen.feed("<tho") == [{"content": "<tho"}]                   # no thinking: all content


def test_reasoning_token_count():
    assert reasoning_token_count(R1, [1, 2, END, 3, 4]) == 3                # up to and including </think>
    assert reasoning_token_count(R1, [1, 2, 3]) == 3                        # never ended: all of them
    assert reasoning_token_count(R1, []) == 0
    assert reasoning_token_count(QWEN3, [START, 1, END, 3]) == 3
    assert reasoning_token_count(QWEN3, [1, 2, 3]) == 0                     # no <think>: no thinking
    assert reasoning_token_count(QWEN3, [START, 1, 2]) == 3
    assert reasoning_token_count(QWEN3, [1, END, START]) == 0
    assert reasoning_token_count(None, [1, END]) == 0
    splitter = ReasoningStream(R1)
    splitter.feed("a", [1])
    splitter.feed("</think>b", [END, 2])
    assert splitter.reasoning_tokens == 2


def test_apply_reasoning_to_a_chat_body():
    body = {"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "plan</think>{\"x\": 1}"}, "finish_reason": "stop"},
        {"index": 1, "message": {"role": "assistant", "content": "unfinished"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}
    apply_reasoning(body, R1, [[1, END, 2, 3], [4, 5, 6]])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "{\"x\": 1}", "reasoning_content": "plan",
                                             "reasoning": "plan"}
    assert body["choices"][1]["message"] == {"role": "assistant", "content": None, "reasoning_content": "unfinished",
                                             "reasoning": "unfinished"}
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}
    plain = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "a</think>b"}}],
             "usage": {"completion_tokens": 1}}
    assert apply_reasoning(plain, None, [[END]]) == {"object": "chat.completion", "choices": [
        {"message": {"role": "assistant", "content": "a</think>b"}}], "usage": {"completion_tokens": 1}}
    completion = {"object": "text_completion", "choices": [{"text": "a</think>b"}]}
    assert apply_reasoning(completion, R1, [[END]])["choices"][0] == {"text": "a</think>b"}


def test_parser_names_and_the_per_model_form():
    assert set(PARSERS) >= {"deepseek_r1", "qwen3"}
    with pytest.raises(ReasoningParserError, match=r"unknown reasoning parser 'r1'.*deepseek_r1, qwen3"):
        parsers_by_model("r1", ["a"])
    assert parsers_by_model(None, ["a"]) == {}
    assert parsers_by_model("qwen3", ["a", "b"]) == {"a": "qwen3", "b": "qwen3"}
    assert parsers_by_model("b=deepseek_r1", ["a", "b"]) == {"b": "deepseek_r1"}
    with pytest.raises(ReasoningParserError, match="names model 'c', which is not served"):
        parsers_by_model("c=qwen3", ["a", "b"])
    with pytest.raises(ReasoningParserError, match="unknown reasoning parser 'nope'"):
        parsers_by_model("a=nope", ["a"])
    check_parser_names(None)
    check_parser_names("qwen3")
    check_parser_names("a=qwen3, b=deepseek_r1")
    for bad in ("nope", "a=qwen3,b=nope"):
        with pytest.raises(ReasoningParserError, match="unknown reasoning parser"):
            check_parser_names(bad)


def test_a_model_without_think_tokens_is_refused(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    with pytest.raises(ReasoningParserError, match="needs '<think>' to be one token of model 'm'"):
        ModelReasoning.of("qwen3", tokenizer, "model 'm'")


@pytest.fixture(scope="module")
def thinking_tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models("qwen3", thinking=True))


@pytest.fixture
def tiny_tokenizer_dir(tiny_models):
    return tiny_models("llama")


SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}


def chat(tokenizer, reasoning, **fields):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **fields}
    return parse_request("/v1/chat/completions", body, tokenizer, 2048, None, reasoning=reasoning)


def test_a_chat_request_to_a_reasoning_model(thinking_tokenizer):
    model = ModelReasoning.of("qwen3", thinking_tokenizer)
    start, end = model.start_token_id, model.end_token_id
    assert (thinking_tokenizer.decode([start]), thinking_tokenizer.decode([end])) == ("<think>", "</think>")

    thinking = chat(thinking_tokenizer, model, response_format=SCHEMA)
    assert thinking.reasoning == Reasoning("qwen3", start, end, False)
    assert thinking.params.structured is not None
    assert thinking.params.structured_after_token_id == end           # the schema applies after </think>

    # enable_thinking reaches the template: the prompt closes an empty think block itself.
    off = chat(thinking_tokenizer, model, response_format=SCHEMA, chat_template_kwargs={"enable_thinking": False})
    assert off.prompt_token_ids[-4:] == [start, *thinking_tokenizer.encode("\n\n", add_special_tokens=False), end,
                                         *thinking_tokenizer.encode("\n\n", add_special_tokens=False)][-4:]
    assert end in off.prompt_token_ids and end not in thinking.prompt_token_ids
    assert off.reasoning.ended_in_prompt
    assert off.params.structured_after_token_id is None               # nothing to wait for

    no_parser = chat(thinking_tokenizer, None, response_format=SCHEMA)
    assert no_parser.reasoning is None and no_parser.params.structured_after_token_id is None
    plain = chat(thinking_tokenizer, model)
    assert plain.reasoning is not None and plain.params.structured_after_token_id is None
    completion = parse_request("/v1/completions", {"prompt": "hi"}, thinking_tokenizer, 2048, None, reasoning=model)
    assert completion.reasoning is None


def test_earlier_thinking_is_dropped_from_the_history(thinking_tokenizer):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>secret</think>\n\nb"},
                {"role": "user", "content": "c"}]
    parsed = parse_request("/v1/chat/completions", {"messages": messages}, thinking_tokenizer, 2048)
    prompt = thinking_tokenizer.decode(parsed.prompt_token_ids)
    assert "secret" not in prompt and "<|im_start|>assistant\nb<|im_end|>" in prompt


# -- bodies rebuilt from Postgres and stream chunks, with tools -------------------------------

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BODY = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [TOOL]}


def test_a_stored_body_splits_the_thinking_before_parsing_tool_calls():
    from datetime import UTC, datetime

    from rein.jobs.results import response_body
    from rein.store.tables import Job, Result

    # A call written inside the thinking is thinking, not a call; the one after </think> is.
    text = f"maybe {CALL}?</think>{CALL}"
    job = Job(id="job_r", endpoint="/v1/chat/completions", model="m", prompt_tokens=9,
              finished_at=datetime(2026, 1, 1, tzinfo=UTC),
              params={"body": BODY, "sampling": {}, "logprobs_mode": None, "reasoning": R1.to_dict()})
    result = Result(job_id="job_r", text=text, token_ids=[1, 2, END, 3, 4], finish_reason="stop", logprobs=None)
    body = response_body(job, result)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == f"maybe {CALL}?"
    assert message["content"] is None and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    job.params = {"body": BODY, "sampling": {}, "logprobs_mode": None}           # no parser: as before
    assert "reasoning_content" not in response_body(job, result)["choices"][0]["message"]
    assert "completion_tokens_details" not in response_body(job, result)["usage"]


def stream_chunks(pieces: list[tuple[str, list[int]]], request_body: dict) -> list[dict]:
    import asyncio

    from rein.api.streams import StreamEvent, openai_chunk_stream

    async def events():
        for seq, (text, ids) in enumerate(pieces, start=1):
            data = {"seq": seq, "text": text, "token_ids": ids}
            if seq == len(pieces):
                data |= {"finish_reason": "stop", "usage": {"prompt_tokens": 3, "completion_tokens": 6}}
            yield StreamEvent(seq, data)

    async def collect():
        return [json.loads(frame.removeprefix("data: ")) async for frame in openai_chunk_stream(
            events(), endpoint="/v1/chat/completions", job_id="job_s", model="m", prompt_tokens=3,
            include_usage=True, request_body=request_body, reasoning=R1) if "[DONE]" not in frame]

    return asyncio.run(collect())


def test_stream_chunks_carry_reasoning_deltas_then_content_and_calls():
    pieces = [("Hmm <", [1]), ("/thi", [2]), ("nk>Sunny", [END, 3]), (".", [4])]
    chunks = stream_chunks(pieces, {"messages": BODY["messages"]})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": ""}, {"reasoning_content": "Hmm ", "reasoning": "Hmm "},
                      {"content": "Sunny"}, {"content": "."}, {}]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}

    with_tools = stream_chunks([(f"a {CALL}", [1, 2]), ("</think>", [END]), (CALL, [5, 6])], BODY)
    deltas = [c["choices"][0]["delta"] for c in with_tools if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == f"a {CALL}"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]          # only the call after </think>
    assert with_tools[-2]["choices"][0]["finish_reason"] == "tool_calls"


# -- served models: REIN_REASONING_PARSER at startup, and what a job stores -------------------


def test_served_models_get_their_parser_and_jobs_store_it(tiny_models):
    from rein.batches.validation import validate_lines
    from rein.core.settings import Settings
    from rein.jobs.registry import ModelLoadError, ModelRegistry

    thinker, plain = tiny_models("qwen3", thinking=True), tiny_models("llama")
    registry = ModelRegistry.load(Settings(models=f"r1={thinker}@256,plain={plain}@256",
                                           reasoning_parser="r1=deepseek_r1"))
    assert registry.get("r1").reasoning.parser.name == "deepseek_r1" and registry.get("plain").reasoning is None
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "r1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
    handed = []
    validate_lines([(json.dumps(line) + "\n").encode()], "/v1/chat/completions", registry, 10,
                   on_valid=handed.append)
    stored = handed[0].job_values()["params"]["reasoning"]
    assert Reasoning.from_dict(stored) == registry.get("r1").reasoning.for_prompt(handed[0].prepared.parsed.prompt_token_ids)

    with pytest.raises(ModelLoadError, match="unknown reasoning parser 'r2'.*deepseek_r1, qwen3"):
        ModelRegistry.load(Settings(models=f"r1={thinker}@256", reasoning_parser="r2"))
    with pytest.raises(ModelLoadError, match="needs '<think>' to be one token of model 'plain'"):
        ModelRegistry.load(Settings(models=f"plain={plain}@256", reasoning_parser="qwen3"))


def test_offline_entry_points_refuse_an_unknown_parser_before_loading(tiny_models, tmp_path, capsys):
    from rein import LLM
    from rein.cli.main import main

    with pytest.raises(ReasoningParserError, match="unknown reasoning parser 'r1'"):
        LLM(str(tiny_models("qwen3", thinking=True)), reasoning_parser="r1")
    source = tmp_path / "in.jsonl"
    source.write_text("")
    assert main(["run-batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "nowhere"),
                 "--reasoning-parser", "r1"]) == 2
    assert "unknown reasoning parser 'r1'" in capsys.readouterr().err    # before looking for the model
