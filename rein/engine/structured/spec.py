"""A structured-output spec, the plain-JSON form of SamplingParams.structured (torch-free):
its cache key, its llguidance grammar, and the check that refuses what cannot be enforced.

{"type": "json_schema", "schema": {...}} | {"type": "json_object"} | {"type": "regex",
"pattern"} | {"type": "choice", "choices"} | {"type": "grammar", "grammar"}, plus, for the
JSON kinds only, the optional keys "whitespace_flexible" (bool) and "whitespace_pattern" (str).
(How a request body's fields become one: rein.openai.structured_fields.)

JSON whitespace. By default JSON outputs use Python's `json.dumps` separators (", " and
": ") and no other whitespace, as vLLM does with `disable_any_whitespace`: a tight grammar
keeps small models from wandering off in newlines and keeps outputs short.
`whitespace_flexible` allows any JSON whitespace; `whitespace_pattern` gives its own.

Every spec is checked with llguidance's own compiler (the one the engine uses), in a
validator process (rein.engine.structured.validator), so a schema keyword llguidance cannot
enforce, an invalid regex or grammar is refused (StructuredSpecError naming where the spec came
from) at intake, at batch validation and in run-batch, not as a failure inside the engine.
Checks are memoized per distinct spec: a batch of 10,000 lines with one schema checks it once.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from rein.engine.errors import CheckTimedOut, StructuredSpecError
from rein.engine.structured.limits import MAX_SPEC_CHARS, limits_problem, parser_limits

# The separators of json.dumps' default format (see the module docstring).
ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "
# The spec types whose output is JSON (they take the whitespace keys).
JSON_KINDS = ("json_schema", "json_object")


def spec_key(spec: dict[str, Any]) -> str:
    """The cache key of a spec: its JSON, keys in their given order (a schema's property
    order is the order the output follows, so two orders are two grammars)."""
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a spec (what the engine compiles). ValueError if the spec
    is malformed (check_spec catches that first for request bodies)."""
    from llguidance import LLMatcher

    kind = spec.get("type")
    if kind in JSON_KINDS:
        schema = spec.get("schema", {}) if kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        # Overrides, not defaults: a schema's own "x-guidance" options may not loosen what is
        # enforced (lenient would skip unknown keywords, coerce_one_of turns oneOf into anyOf).
        options: dict[str, Any] = {"lenient": False, "coerce_one_of": False}
        if spec.get("whitespace_pattern") is not None:
            options.update(whitespace_flexible=True, whitespace_pattern=spec["whitespace_pattern"])
        elif spec.get("whitespace_flexible"):
            options.update(whitespace_flexible=True)
        else:
            options.update(whitespace_flexible=False, item_separator=ITEM_SEPARATOR, key_separator=KEY_SEPARATOR)
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(_str(spec.get("pattern"), "pattern"))
    if kind == "choice":
        choices = spec.get("choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choices must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if kind == "grammar":
        from llguidance import grammar_from

        return grammar_from("grammar", _str(spec.get("grammar"), "grammar"))   # Lark, or GBNF converted to Lark
    raise ValueError(f"unknown structured type {kind!r}")


def check_spec(spec: dict[str, Any], param: str = "structured") -> None:
    """Refuse (StructuredSpecError naming `param`) a spec past rein's caps (rein.engine.structured.limits) or
    one llguidance cannot compile or enforce (checked in a validator process,
    rein.engine.structured.validator; CheckTimedOut when it took too long to tell).
    ValidatorUnavailable when no validator could answer. The answer may wait for a validator
    process to start (a fraction of a second): never called on the engine's step thread."""
    from rein.engine.structured.validator import CompileTimeout

    key = spec_key(spec)
    if len(key) > MAX_SPEC_CHARS:
        raise StructuredSpecError(f"{param} is {len(key)} characters as JSON; rein takes at most {MAX_SPEC_CHARS}. "
                                  f"Make it smaller.", param)
    problem = limits_problem(spec)
    if problem:
        raise StructuredSpecError(f"{param} is too large: {problem}", param)
    try:
        problem = _spec_problem(key)
    except CompileTimeout as exc:
        raise CheckTimedOut(f"{param} cannot be enforced: {exc}", param) from None
    if problem:
        raise StructuredSpecError(f"{param} cannot be enforced: {problem}", param)


# Memo of spec_problem: digest of the spec's key -> problem ("" when none). Digests, not the
# keys themselves, so a thousand large schemas do not stay in memory.
_CHECKED: OrderedDict[bytes, str] = OrderedDict()
_CHECKED_MAX = 4096
_checked_lock = threading.Lock()


def spec_problem(key: str) -> str | None:
    """What is wrong with the spec whose spec_key is `key`, in words, or None. Memoized:
    the same spec on many lines is compiled for checking once."""
    from rein.engine.structured.validator import CompileTimeout

    try:
        return _spec_problem(key)
    except CompileTimeout as exc:
        return str(exc)   # not remembered: a busy machine's verdict


def _spec_problem(key: str) -> str | None:
    """spec_problem, raising CompileTimeout for a spec that did not compile in time."""
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    with _checked_lock:
        known = _CHECKED.get(digest)
        if known is not None:
            _CHECKED.move_to_end(digest)
            return known or None
    from rein.engine.structured.validator import pool

    validators = pool()
    problem = (validators.problem(key) if validators else find_problem(json.loads(key))) or ""
    with _checked_lock:
        _CHECKED[digest] = problem
        if len(_CHECKED) > _CHECKED_MAX:
            _CHECKED.popitem(last=False)
    return problem or None


def find_problem(spec: dict[str, Any]) -> str | None:
    """What llguidance finds wrong with the spec, or None: run in a validator process."""
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(spec)
    except ValueError as exc:
        return str(exc)
    error = LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if not error:
        return None
    if spec.get("type") in JSON_KINDS and error.startswith("Unimplemented keys"):
        return (f"the schema uses JSON-schema keywords rein cannot enforce "
                f"({error.removeprefix('Unimplemented keys: ')}); remove them (rein constrains with "
                f"llguidance, which enforces every keyword it accepts)")
    if "oneOf" in error:
        return "oneOf branches that can overlap cannot be enforced; use anyOf, or make the branches disjoint"
    return error.strip()


def _str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


