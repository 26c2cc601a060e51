"""What rein cannot take (rein.core.input_checks), and how the OpenAI parsing uses it for batch
lines and the values that reach the engine (rein.openai.request)."""

from __future__ import annotations

import json

import pytest

from rein.core.input_checks import (
    INT64_MAX,
    INT64_MIN,
    MAX_JSON_DEPTH,
    BadInput,
    check_json,
    text_problem,
)
from rein.openai.batch_lines import custom_id_of, parse_batch_line
from rein.openai.endpoints import COMPLETIONS
from rein.openai.errors import RequestError
from rein.openai.request import parse_request


def bad(value, root=None) -> BadInput:
    with pytest.raises(BadInput) as info:
        check_json(value, root)
    return info.value


@pytest.mark.parametrize("text", ["", "plain ascii", "naïve ☃ 😀", "\x01\x1f\x7f", "\U0010ffff"])
def test_text_rein_can_take(text):
    assert text_problem(text) is None


@pytest.mark.parametrize("text, words", [
    ("a\x00b", ["NUL character (U+0000) at index 1", "remove it"]),
    ("ünïcode\x00", ["at index 7"]),
    ("x\ud800", ["lone UTF-16 surrogate (U+D800) at index 1", "surrogate pair"]),
    ("\udfff", ["U+DFFF"]),
])
def test_text_rein_cannot_take(text, words):
    problem = text_problem(text)
    assert problem is not None and all(w in problem for w in words), problem


def test_json_paths_name_the_first_bad_value_in_document_order():
    value = {"a": [1, {"b": "ok"}, {"c": "x\x00"}], "d": "\x00"}
    error = bad(value)
    assert error.param == "a[2].c" and error.message.startswith("a[2].c: contains a NUL")
    assert bad(value, root="body").param == "body.a[2].c"
    assert bad(["fine", "\ud800"]).param == "[1]"


def test_object_keys_are_checked_and_name_their_object():
    assert bad({"m": {"ok": 1, "k\x00": 2}}).param == "m"
    error = bad({"\ud800": 1})
    assert error.param is None and error.message.startswith("the request body: an object key")


def test_numbers():
    check_json({"a": INT64_MAX, "b": INT64_MIN, "c": 1e308, "d": -5e-324, "e": True, "f": None})
    assert "64-bit integer range" in bad({"a": INT64_MAX + 1}).message
    assert bad({"a": [INT64_MIN - 1]}).param == "a[0]"
    assert "not finite" in bad({"t": float("inf")}).message
    assert bad({"t": float("nan")}).param == "t"
    assert "a 1330-bit integer" in bad({"n": 2**1329}).message   # not printed in full


def test_depth():
    nested: list = []
    for _ in range(MAX_JSON_DEPTH - 1):
        nested = [nested]
    check_json(nested)                 # MAX_JSON_DEPTH levels of containers
    assert "nested deeper than" in bad([nested]).message
    deep: dict = {}
    for _ in range(10_000):            # no recursion: no RecursionError either
        deep = {"k": deep}
    assert "nested deeper than" in bad(deep).message


# -- batch lines and requests -----------------------------------------------------------------


def _line(**fields) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": COMPLETIONS,
                       "body": {"prompt": "hi"}, **fields})


def test_batch_lines_with_text_rein_cannot_take_name_the_line():
    with pytest.raises(RequestError) as info:
        parse_batch_line(_line(body={"prompt": "a\x00b"}), 7)
    assert info.value.message.startswith("line 7: body.prompt: contains a NUL")
    assert (info.value.param, info.value.code) == ("body.prompt", "invalid_value")
    with pytest.raises(RequestError) as info:
        parse_batch_line('{"custom_id": "c\x00"}', 3)   # a raw NUL: not JSON, said plainly
    assert info.value.code == "invalid_json_line" and "line 3: the line contains a NUL" in info.value.message
    with pytest.raises(RequestError) as info:
        parse_batch_line(_line(body={"prompt": "hi", "seed": 2**64}), 2)
    assert info.value.param == "body.seed"


def test_custom_id_of_a_bad_line_is_only_kept_when_it_can_be_written():
    assert custom_id_of(_line(custom_id="fine", body=5)) == "fine"
    assert custom_id_of(_line(custom_id="x\x00", body=5)) is None
    assert custom_id_of(_line(custom_id="x\ud800", body=5)) is None


@pytest.mark.parametrize("body, param", [
    ({"prompt": [1, 2048]}, "prompt"),
    ({"prompt": [[2**31]]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [5, 2048]}, "stop_token_ids"),
    ({"prompt": "hi", "repetition_penalty": 2.5}, "repetition_penalty"),
    ({"prompt": "hi", "repetition_penalty": 0.001}, "repetition_penalty"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [""]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0, "max_completion_tokens": 3}, "max_tokens"),
    ({"prompt": "hi", "stream_options": "yes"}, "stream_options"),
    ({"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
def test_values_that_would_break_the_engine_or_storage_are_refused(tokenizer, body, param):
    with pytest.raises(RequestError) as info:
        parse_request(COMPLETIONS, body, tokenizer, 256)
    assert info.value.param == param, info.value.message


def test_the_vocabulary_bounds_token_ids(tokenizer):
    vocab = len(tokenizer)
    parsed = parse_request(COMPLETIONS, {"prompt": [0, vocab - 1], "stop_token_ids": [vocab - 1],
                                         "repetition_penalty": 2.0}, tokenizer, 256)
    assert parsed.prompt_token_ids == [0, vocab - 1]
    with pytest.raises(RequestError) as info:
        parse_request(COMPLETIONS, {"prompt": [0, vocab]}, tokenizer, 256)
    assert f"ids run from 0 to {vocab - 1}" in info.value.message
