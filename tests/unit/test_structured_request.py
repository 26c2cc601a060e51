"""Structured-output fields of request bodies (rein.openai.structured_fields, through
rein.openai.request.parse_request): the spec each spelling gives, and 400s naming the parameter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rein.engine.errors import StructuredSpecError
from rein.engine.structured.limits import MAX_CHOICES
from rein.engine.structured.spec import spec_key, spec_problem
from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.request import parse_request
from rein.openai.structured_fields import check_spec

MAX_LEN = 256
CHAT = [{"role": "user", "content": "Give me JSON"}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def spec_of(tokenizer, endpoint=CHAT_COMPLETIONS, **fields):
    base = {"messages": CHAT} if endpoint == CHAT_COMPLETIONS else {"prompt": "x"}
    return parse_request(endpoint, {**base, **fields}, tokenizer, MAX_LEN).params.structured


def error_of(tokenizer, endpoint=CHAT_COMPLETIONS, **fields) -> RequestError:
    with pytest.raises(RequestError) as info:
        spec_of(tokenizer, endpoint, **fields)
    assert info.value.code == "invalid_request_error"
    return info.value


@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, {"type": "json_object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                                 "strict": True, "description": "d"}}},
     {"type": "json_schema", "schema": SCHEMA}),
    ({"structured_outputs": {"json": SCHEMA}}, {"type": "json_schema", "schema": SCHEMA}),
    ({"structured_outputs": {"json": '{"type": "integer"}'}}, {"type": "json_schema", "schema": {"type": "integer"}}),
    ({"structured_outputs": {"regex": "[a-z]+"}}, {"type": "regex", "pattern": "[a-z]+"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"type": "choice", "choices": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"type": "grammar", "grammar": 'root ::= "a" | "b"'}),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
     {"type": "json_object", "whitespace_flexible": True}),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "[ ]?"}},
     {"type": "json_schema", "schema": SCHEMA, "whitespace_pattern": "[ ]?"}),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "auto"}, {"type": "json_schema", "schema": SCHEMA}),
    ({"guided_regex": r"\d{3}"}, {"type": "regex", "pattern": r"\d{3}"}),
    ({"guided_choice": ["a", "b\"c"]}, {"type": "choice", "choices": ["a", "b\"c"]}),
    ({"guided_grammar": 'start: "x"+'}, {"type": "grammar", "grammar": 'start: "x"+'}),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"},
     {"type": "json_schema", "schema": SCHEMA, "whitespace_pattern": " *"}),
])
def test_each_spelling_gives_its_spec(tokenizer, fields, expected):
    assert spec_of(tokenizer, **fields) == expected


def test_completions_take_the_same_fields(tokenizer):
    assert spec_of(tokenizer, COMPLETIONS, response_format={"type": "json_object"}) == {"type": "json_object"}
    assert spec_of(tokenizer, COMPLETIONS, guided_choice=["x"]) == {"type": "choice", "choices": ["x"]}


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}}},
     "response_format.json_schema.strict", "boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "extra": 1}}},
     "response_format.json_schema.extra", "remove"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}},
     "response_format.json_schema.schema", '"not"'),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}},
     "response_format.json_schema.schema", "oneOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/$defs/missing"}}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "color"}}}},
     "response_format.json_schema.schema", "format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex", "unclosed"),
    ({"structured_outputs": {"regex": "(?=look)ahead"}}, "structured_outputs.regex", "look-around"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", "undefined_rule"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"json_object": True, "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties", "additionalProperties"),
    ({"structured_outputs": {"choice": ["a"], "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "JSON"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_json": [1, 2]}, "guided_json", "schema object"),
    ({"guided_regex": ""}, "guided_regex", "non-empty"),
    ({"guided_choice": ["a", 3]}, "guided_choice", "strings"),
    ({"guided_choice": ["c"] * (MAX_CHOICES + 1)}, "guided_choice", str(MAX_CHOICES)),
    ({"guided_grammar": "root ::= ( \"a\""}, "guided_grammar", "Expected"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "foo"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json", "only one"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
])
def test_bad_structured_fields_name_the_parameter(tokenizer, fields, param, words):
    err = error_of(tokenizer, **fields)
    assert err.param == param, err.message
    assert words in err.message, err.message


def test_a_huge_spec_is_refused_with_the_limit(tokenizer):
    schema = {"type": "object", "properties": {f"p{i:05d}": {"type": "string"} for i in range(5000)}}
    err = error_of(tokenizer, guided_json=schema)
    assert err.param == "guided_json" and "at most 100000" in err.message


def test_checks_are_memoized_per_spec():
    spec = {"type": "regex", "pattern": "memo-[0-9]+"}
    key = spec_key(spec)
    assert spec_problem(key) is None
    assert spec_problem(key) is None   # second call served from the memo (covered by timing in bench)
    with pytest.raises(RequestError) as info:
        check_spec({"type": "regex", "pattern": "memo-("}, "x")
    assert info.value.param == "x"


def test_the_engine_refuses_a_spec_in_its_own_type_and_the_wire_says_it_as_a_400():
    from rein.engine.structured.spec import check_spec as engine_check

    bad = {"type": "regex", "pattern": "wire-("}
    with pytest.raises(StructuredSpecError) as refused:
        engine_check(bad, "structured_outputs.regex")
    assert not isinstance(refused.value, RequestError)
    with pytest.raises(RequestError) as answered:
        check_spec(bad, "structured_outputs.regex")
    assert (answered.value.message, answered.value.param, answered.value.code) == (
        refused.value.message, "structured_outputs.regex", "invalid_request_error")
    assert answered.value.message.startswith("structured_outputs.regex cannot be enforced: ")


def test_key_keeps_property_order():
    a = {"type": "json_schema", "schema": {"properties": {"a": {}, "b": {}}}}
    b = {"type": "json_schema", "schema": {"properties": {"b": {}, "a": {}}}}
    assert spec_key(a) != spec_key(b)


def test_parsing_stays_torch_free():
    # The API process parses and checks bodies; it must not import torch (nor xgrammar, which would).
    code = ("import sys, rein.openai.request as f, rein.openai.structured_fields as r;"
            "r.check_spec({'type': 'json_schema', 'schema': {'type': 'object'}}, 'guided_json');"
            "print('torch' in sys.modules, 'xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
