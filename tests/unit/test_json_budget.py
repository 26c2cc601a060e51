"""rein.core.json_budget: a JSON text's parse refused from a count of what it would build,
strings not counted as structure, and within the caps a parse that costs a small multiple of
the text."""

from __future__ import annotations

import json
import tracemalloc
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rein.core.input_checks import BadInput
from rein.core.json_budget import (
    MAX_JSON_CONTAINERS,
    MAX_JSON_VALUES,
    check_json_budget,
    json_shape_counts,
    parse_json_within_budget,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=40)


def _exact(value) -> tuple[int, int]:
    """(containers, values) of a parsed JSON value, counted by walking it."""
    if isinstance(value, list):
        counts = [_exact(item) for item in value]
        return 1 + sum(c for c, _ in counts), 1 + sum(v for _, v in counts)
    if isinstance(value, dict):
        counts = [_exact(item) for item in value.values()]
        return 1 + sum(c for c, _ in counts), 1 + sum(v for _, v in counts)
    return 0, 1


@given(json_values)
def test_the_counts_bound_what_the_parse_builds(value):
    raw = json.dumps(value).encode()
    containers, values = json_shape_counts(raw)
    exact_containers, exact_values = _exact(value)
    assert containers >= exact_containers and values >= exact_values
    assert parse_json_within_budget(raw) == value


def test_commas_and_brackets_inside_strings_are_text():
    raw = json.dumps({"content": "[{a, b}], " * 200_000}).encode()   # 2 M "structure" characters
    assert json_shape_counts(raw) == (1, 2)
    assert parse_json_within_budget(raw)["content"].startswith("[{a, b}]")
    escaped = json.dumps({"content": '\\"[,' * 400_000}).encode()    # escaped quotes do not end it
    assert json_shape_counts(escaped) == (1, 2)


@pytest.mark.parametrize(("raw", "words"), [
    (b"[" + b"[]," * MAX_JSON_CONTAINERS + b"[]]", "arrays and objects"),
    (b"[" + b'{"a":1},' * MAX_JSON_CONTAINERS + b"{}]", "arrays and objects"),
    (b"[" + b"1," * MAX_JSON_VALUES + b"1]", "JSON values"),
    (b'["x", ' + b'"",' * MAX_JSON_VALUES + b'""]', "JSON values"),
])
def test_past_a_cap_nothing_is_parsed(raw, words, monkeypatch):
    import rein.core.json_budget as budget

    monkeypatch.setattr(budget, "json", SimpleNamespace(loads=lambda *_: pytest.fail("parsed past the caps")))
    with pytest.raises(BadInput) as caught:
        check_json_budget(raw, "The line")
    assert words in caught.value.message and caught.value.message.startswith("The line holds")
    with pytest.raises(BadInput):
        parse_json_within_budget(raw)


def test_nesting_past_the_parser_s_limit_is_bad_input():
    with pytest.raises(BadInput, match="nested deeper"):
        parse_json_within_budget(b"[" * 10_000 + b"]" * 10_000)


@pytest.mark.parametrize("unit", [b"[],", b"{},", b'{"a":1},', b"1.5,", b'"ab",'])
def test_within_the_caps_a_parse_costs_a_small_multiple_of_the_text(unit):
    """At the caps, the costliest shapes rein lets through build at most ~30x their text,
    and never more than ~64 MiB (the figures beside the caps)."""
    per_cap = MAX_JSON_CONTAINERS if unit.startswith((b"[", b"{")) else MAX_JSON_VALUES
    raw = b"[" + unit * (per_cap - 2) + unit.rstrip(b",") + b"]"
    tracemalloc.start()
    try:
        value = parse_json_within_budget(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(value) == per_cap - 1
    assert peak < 72 * 1024 * 1024, peak
    assert peak < 40 * len(raw), (peak, len(raw))


@given(json_values)
def test_text_and_bytes_count_alike(value):
    text = json.dumps(value, ensure_ascii=False)
    assert json_shape_counts(text) == json_shape_counts(text.encode())


def test_a_batch_line_past_the_caps_is_that_line_s_error_unparsed(monkeypatch):
    import rein.core.json_budget as budget
    from rein.openai.batch_lines import custom_id_of, parse_batch_line
    from rein.openai.errors import RequestError

    line = ('{"custom_id": "r1", "method": "POST", "url": "/v1/completions", "body": {"prompt": ['
            + "[]," * MAX_JSON_CONTAINERS + "[]]}}")
    monkeypatch.setattr(budget, "json", SimpleNamespace(loads=lambda *_: pytest.fail("parsed past the caps")))
    with pytest.raises(RequestError) as caught:
        parse_batch_line(line, 7)
    assert str(caught.value).startswith("line 7: The line holds") and caught.value.code == "invalid_json_line"
    assert custom_id_of(line) is None
