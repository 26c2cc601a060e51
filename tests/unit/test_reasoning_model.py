"""A reasoning model end to end offline: a tiny random-weight model with <think> tokens and a
Qwen3-style template (rein.fixtures.tiny_tokenizer), run by `rein run-batch` with the
deepseek_r1 parser. A logit bias on </think> makes the random model end its "thinking" after a
few free tokens; the answer after it is held to a JSON schema while the thinking was not.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from rein.engine import EngineConfig, LLMEngine, SamplingParams
from rein.offline.run_batch import run_batch
from rein.openai.reasoning import ModelReasoning

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "classify this"}]


@pytest.fixture(scope="module")
def engine(tiny_models):
    return LLMEngine(EngineConfig(model=str(tiny_models("qwen3", thinking=True)), kv_cache_memory="8MiB",
                                  max_model_len=256, reasoning_parser="deepseek_r1"))


@pytest.fixture(scope="module")
def think_ids(engine):
    model = ModelReasoning.of("deepseek_r1", engine.tokenizer)
    return model.start_token_id, model.end_token_id


def generate(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request("probe", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def end_bias(engine, think_ids):
    """A bias on </think> under which the greedy, unconstrained model thinks a few tokens first."""
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    end = think_ids[1]
    for bias in (2, 3, 4, 5, 6, 7, 8):
        tokens = generate(engine, prompt, SamplingParams(max_tokens=40, temperature=0, logit_bias={end: bias}))
        if end in tokens and tokens.index(end) >= 2:
            return bias
    pytest.fail("no bias on </think> made the tiny model think a few tokens first")


def test_the_engine_holds_the_grammar_until_the_thinking_ends(engine, think_ids, end_bias):
    end = think_ids[1]
    prompt = engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    spec = {"type": "json_schema", "schema": SCHEMA}
    free = generate(engine, prompt, SamplingParams(max_tokens=40, temperature=0, logit_bias={end: end_bias}))
    held = generate(engine, prompt, SamplingParams(max_tokens=60, temperature=0, logit_bias={end: end_bias},
                                                   structured=spec, structured_after_token_id=end))
    thinking = free.index(end) + 1
    assert held[:thinking] == free[:thinking]          # the thinking was not constrained
    answer = engine.tokenizer.decode(held[thinking:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), SCHEMA)    # the answer after </think> was
    at_once = generate(engine, prompt, SamplingParams(max_tokens=60, temperature=0, logit_bias={end: end_bias},
                                                      structured=spec))
    assert end not in at_once                          # without the wait, the grammar starts at once
    jsonschema.validate(json.loads(engine.tokenizer.decode(at_once, skip_special_tokens=True)), SCHEMA)


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, **body}}


def test_run_batch_splits_the_thinking_counts_it_and_constrains_the_answer(engine, think_ids, end_bias, tmp_path):
    end = think_ids[1]
    schema_format = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    bias = {str(end): end_bias}
    lines = [line("json", response_format=schema_format, logit_bias=bias),
             line("free", logit_bias=bias, max_tokens=12),
             line("no-thinking", response_format=schema_format, logit_bias=bias,
                  chat_template_kwargs={"enable_thinking": False})]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_batch(engine, source, out, progress=False, order="file")
    assert summary.requests_ok == 3, out.read_text()
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, out.read_text().splitlines())}
    tokenizer = engine.tokenizer

    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    free = generate(engine, prompt, SamplingParams(max_tokens=40, temperature=0, logit_bias={end: end_bias}))
    thinking_tokens = free.index(end) + 1
    thinking_text = tokenizer.decode(free[:thinking_tokens - 1], skip_special_tokens=True)

    answer = bodies["json"]["choices"][0]["message"]
    assert answer["reasoning_content"] == thinking_text and "</think>" not in answer["content"]
    jsonschema.validate(json.loads(answer["content"]), SCHEMA)
    assert bodies["json"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking_tokens}
    assert bodies["json"]["usage"]["completion_tokens"] > thinking_tokens

    free_answer = bodies["free"]["choices"][0]["message"]
    assert free_answer["reasoning_content"] == thinking_text
    assert free_answer["content"] == (tokenizer.decode(free[thinking_tokens:12], skip_special_tokens=True) or None)
    assert bodies["free"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking_tokens}

    # enable_thinking: false closes the think block in the prompt: no thinking, the schema from the start.
    plain = bodies["no-thinking"]["choices"][0]["message"]
    assert plain["reasoning_content"] is None
    jsonschema.validate(json.loads(plain["content"]), SCHEMA)
    assert bodies["no-thinking"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
