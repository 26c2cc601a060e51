"""validate_lines without services: what it hands on, what it reports, with the tiny model's tokenizer."""

from __future__ import annotations

import json

import pytest

from rein.batches.validation import MAX_REPORTED_ERRORS, validate_lines
from rein.core.settings import Settings
from rein.jobs.registry import ModelRegistry


@pytest.fixture(scope="module")
def registry(tiny_models) -> ModelRegistry:
    model = tiny_models("llama")
    return ModelRegistry.load(Settings(models=f"tiny={model}@256,other={model}@256"))


def raw(*lines: dict | str | bytes) -> list[bytes]:
    return [x if isinstance(x, bytes) else ((x if isinstance(x, str) else json.dumps(x)) + "\n").encode()
            for x in lines]


def chat(custom_id: str, model: str = "tiny", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}}


def test_good_lines_are_handed_on_with_their_jobs(registry):
    handed = []
    result = validate_lines(raw(chat("a"), "   ", chat("b", temperature=0.0)), "/v1/chat/completions", registry,
                            10, on_valid=handed.append)
    assert result.ok and result.valid == result.requests == 2 and result.model == "tiny"
    assert [(v.line, v.custom_id) for v in handed] == [(1, "a"), (3, "b")]
    values = handed[1].job_values()
    assert values["model"] == "tiny" and values["custom_id"] == "b" and values["batch_line"] == 3
    assert values["params"]["sampling"]["temperature"] == 0.0 and values["params"]["sampling"]["max_tokens"] == 4
    assert values["prompt_tokens"] == len(values["prompt_token_ids"]) > 0


def test_nothing_is_handed_on_after_a_bad_line(registry):
    handed = []
    result = validate_lines(raw(chat("a"), chat("b", model="other"), chat("c"), b"\xff\xfe\n"),
                            "/v1/chat/completions", registry, 10, on_valid=handed.append)
    assert [v.custom_id for v in handed] == ["a"]
    assert [(e["line"], e["code"], e["param"]) for e in result.errors] == [
        (2, "mismatched_model", "body.model"), (4, "invalid_json_line", None)]


def test_sampling_and_context_errors_name_the_body_field(registry):
    result = validate_lines(raw(chat("a", temperature="hot"), chat("b", max_tokens=300)), "/v1/chat/completions",
                            registry, 10)
    assert [(e["line"], e["param"]) for e in result.errors] == [(1, "body.temperature"), (2, "body.messages")]
    assert result.errors[1]["code"] == "context_length_exceeded"


def test_reported_errors_are_capped(registry):
    result = validate_lines(raw(*["{"] * (MAX_REPORTED_ERRORS + 5)), "/v1/chat/completions", registry, 10**6)
    assert len(result.errors) == MAX_REPORTED_ERRORS and result.requests == MAX_REPORTED_ERRORS + 5


def test_a_grammar_that_crashes_the_compiler_fails_its_line_only(registry, monkeypatch):
    from rein.engine.structured import limits

    monkeypatch.setattr(limits, "MAX_GRAMMAR_RULES", 10_000)   # past the cap, into a validator process
    bomb = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3500)) + 'r3500: "a"\n'
    result = validate_lines(raw(chat("a"), chat("bomb", guided_grammar=bomb), chat("c")),
                            "/v1/chat/completions", registry, 10, on_valid=lambda line: None)
    assert [(e["line"], e["param"]) for e in result.errors] == [(2, "body.guided_grammar")]
    assert "crashed rein's grammar compiler" in result.errors[0]["message"]


def test_before_line_runs_for_every_line_and_can_stop_it(registry):
    """The manager's deadline check runs before each line, after a bad one too (it used to run
    only when a valid line was stored, so a file whose first line was bad ran to its end)."""
    seen = []

    class Deadline(Exception):
        pass

    def before_line(number):
        seen.append(number)
        if number == 4:
            raise Deadline

    lines = raw(chat("a", model="nope"), *(chat(f"x{i}") for i in range(10)))
    with pytest.raises(Deadline):
        validate_lines(lines, "/v1/chat/completions", registry, 100, before_line=before_line)
    assert seen == [1, 2, 3, 4]
