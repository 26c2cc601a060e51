"""A served model's tool calls in a chosen format, on the tiny llama model's real engine:
`rein run-batch` under `tool_call_parser="llama3_json"` (the rein.LLM keyword, --tool-call-parser's
twin) answers a tools request with tool_calls. The random weights write no calls by themselves, so
a JSON schema holds the answer to a Llama 3 call, as response_format may in tool_choice auto."""

from __future__ import annotations

import json

import pytest

from rein import LLM
from rein.offline.run_batch import run_batch

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A Llama 3 call: {"name": "get_weather", "parameters": {"city": "Paris"}}
CALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"], "properties": {
    "name": {"enum": ["get_weather"]},
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris"]}}}}}


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models("llama"), kv_cache_memory="32MiB", max_num_seqs=2, max_model_len=512,
               tool_call_parser="llama3_json")


def test_run_batch_reads_calls_in_the_chosen_format(llm, tmp_path):
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
            "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "call", "schema": CALL_SCHEMA}}}
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n")
    summary = run_batch(llm.engine, src, dst, progress=False)
    assert summary.requests_failed == 0
    [line] = map(json.loads, dst.read_text().splitlines())
    choice = line["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_the_ending_eos_is_not_text_where_special_tokens_are_kept(llm):
    """The mistral format keeps special tokens ([TOOL_CALLS] is one); the EOS that ends the
    answer must not land in its content (vLLM leaves it out too)."""
    from rein import SamplingParams

    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(max_tokens=4, temperature=0, logit_bias={eos: 100}, skip_special_tokens=False)
    [out] = llm.generate("hello", params, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == ""
