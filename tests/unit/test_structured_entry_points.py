"""Structured outputs through batch validation (line numbers) and `rein run-batch` (offline)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from rein.batches.validation import validate_lines
from rein.core.settings import Settings
from rein.engine import EngineConfig, LLMEngine
from rein.jobs.registry import ModelRegistry
from rein.offline.run_batch import run_batch

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["spam", "ham"]}, "score": {"type": "integer",
                                                                                      "minimum": 0, "maximum": 9}},
          "required": ["label", "score"], "additionalProperties": False}
BAD_SCHEMA = {"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}


def line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "classify"}], "max_tokens": 40,
                     "temperature": 0.8, "seed": 1, **body}}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama")


def test_batch_validation_names_the_line_and_the_parameter(model):
    registry = ModelRegistry.load(Settings(models=f"tiny={model}@256"))
    lines = [line("a", response_format=json_format(SCHEMA)), line("b", response_format=json_format(BAD_SCHEMA)),
             line("c", structured_outputs={"regex": "(x"})]
    handed = []
    result = validate_lines([(json.dumps(x) + "\n").encode() for x in lines], "/v1/chat/completions", registry, 10,
                            on_valid=handed.append)
    assert [(e["line"], e["param"]) for e in result.errors] == [
        (2, "body.response_format.json_schema.schema"), (3, "body.structured_outputs.regex")]
    assert result.errors[0]["message"].startswith("line 2:") and "contains" in result.errors[0]["message"]
    assert handed[0].job_values()["params"]["sampling"]["structured"] == {"type": "json_schema", "schema": SCHEMA}


def test_run_batch_constrains_each_line_and_refuses_bad_ones(model, tmp_path):
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_memory="8MiB", max_model_len=256))
    lines = [line(f"ok{i}", response_format=json_format(SCHEMA), seed=i) for i in range(4)]
    lines.insert(2, line("bad", response_format=json_format(BAD_SCHEMA)))
    lines.append(line("pick", guided_choice=["red", "green"]))
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    summary = run_batch(engine, source, out, progress=False)
    results = {r["custom_id"]: r for r in map(json.loads, out.read_text().split("\n")[:-1])}
    assert summary.requests_ok == 5 and summary.requests_failed == 1
    assert results["bad"]["error"]["message"].startswith("line 3:") and "contains" in results["bad"]["error"]["message"]
    assert any(results[f"ok{i}"]["response"]["body"]["choices"][0]["finish_reason"] == "stop" for i in range(4))
    for i in range(4):
        choice = results[f"ok{i}"]["response"]["body"]["choices"][0]
        if choice["finish_reason"] == "stop":
            jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        else:
            assert choice["finish_reason"] == "length"
    assert results["pick"]["response"]["body"]["choices"][0]["message"]["content"] in ("red", "green")
    assert engine.grammars.cache.compiles == 2   # one schema for four lines, one choice list
