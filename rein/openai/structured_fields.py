"""A request body's structured-output fields, turned into one `structured` spec (torch-free).

Three spellings ask for the same engine feature:

* OpenAI's `response_format`: {"type": "text"} (nothing), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}};
* vLLM's `structured_outputs` object: exactly one of `json` (a schema, object or JSON
  text), `regex`, `choice`, `grammar` (Lark or GBNF/EBNF) or `json_object: true`, plus
  `whitespace_pattern` / `disable_any_whitespace`;
* vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern` and `guided_decoding_backend`.

Each becomes the plain-JSON spec of SamplingParams.structured (rein.engine.structured.spec,
which says what the spec holds). JSON outputs are tight by default (json.dumps' separators,
as vLLM's `disable_any_whitespace`); `disable_any_whitespace: false` (vLLM) allows any JSON
whitespace (the spec's "whitespace_flexible"), `whitespace_pattern` gives its own.

Every spec is checked with the engine's own check (rein.engine.structured.spec.check_spec:
rein's caps, then llguidance's compiler in a validator process), so a schema keyword
llguidance cannot enforce, an invalid regex or grammar gets a 400 naming the parameter at
intake, at batch validation (with the line number) and in run-batch, not a failure inside
the engine.
"""

from __future__ import annotations

import json
from typing import Any

from rein.core.input_checks import MAX_JSON_DEPTH, BadInput, check_json, json_type
from rein.engine.errors import StructuredSpecError
from rein.engine.structured.limits import MAX_CHOICES
from rein.engine.structured.spec import JSON_KINDS
from rein.engine.structured.spec import check_spec as check_engine_spec
from rein.openai.errors import RequestError

# vLLM's guided_decoding_backend values that mean "whatever the server uses" or rein's own library.
ACCEPTED_BACKENDS = ("auto", "guidance", "llguidance")

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_JSON_SCHEMA_KEYS = ("name", "schema", "strict", "description")
_STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_OUTPUTS_OPTIONS = ("whitespace_pattern", "disable_any_whitespace", "disable_fallback",
                               "disable_additional_properties")
_GUIDED_KINDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Body fields this module reads (rein.openai.fields adds them to the fields it knows).
BODY_FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED_KINDS, "guided_whitespace_pattern",
                         "guided_decoding_backend"})


def structured_from_body(body: dict[str, Any]) -> dict[str, Any] | None:
    """The body's `structured` spec, or None when it asks for free text. Raises RequestError
    (naming the parameter) for a malformed field, two fields that both constrain the
    output, or a schema / regex / grammar llguidance cannot enforce."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        spec = _from_response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _from_structured_outputs(body["structured_outputs"])))
    found.extend((name, _from_guided(name, body[name])) for name in _GUIDED_KINDS if body.get(name) is not None)
    _check_backend(body.get("guided_decoding_backend"))
    pattern = body.get("guided_whitespace_pattern")
    if len(found) > 1:
        first, second = found[0][0], found[1][0]
        raise RequestError(f"{first} and {second} both constrain the output: give only one of them", second)
    if not found:
        if pattern is not None:
            raise RequestError("guided_whitespace_pattern only applies with guided_json (or another JSON "
                               "constraint); leave it out", "guided_whitespace_pattern")
        return None
    param, spec = found[0]
    if pattern is not None:
        _add_whitespace_pattern(spec, pattern, "guided_whitespace_pattern")
    check_spec(spec, _spec_param(param, spec))
    return spec


def check_spec(spec: dict[str, Any], param: str) -> None:
    """The engine's check of a spec (rein.engine.structured.spec.check_spec), its refusal as a
    400 naming `param`. ValidatorUnavailable (no validator could answer) passes through."""
    try:
        check_engine_spec(spec, param)
    except StructuredSpecError as exc:
        raise RequestError(exc.message, exc.param) from None


# -- the three spellings ----------------------------------------------------------------------


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise RequestError(f"response_format must be an object such as {{\"type\": \"json_object\"}}, got "
                           f"{json_type(value)}", "response_format")
    kind = value.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise RequestError(f"response_format.type must be one of {', '.join(_RESPONSE_FORMAT_TYPES)}, got "
                           f"{json.dumps(kind)}", "response_format.type")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _refuse_extra(value, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise RequestError("response_format.json_schema must be an object {\"name\", \"schema\", \"strict\"} "
                           f"when type is json_schema, got {json_type(inner)}", "response_format.json_schema")
    _refuse_extra(inner, set(_JSON_SCHEMA_KEYS), "response_format.json_schema")
    name = inner.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("response_format.json_schema.name is required: a non-empty string naming the format",
                           "response_format.json_schema.name")
    for key, kinds, what in (("strict", (bool,), "a boolean"), ("description", (str,), "a string")):
        if inner.get(key) is not None and not isinstance(inner[key], kinds):
            raise RequestError(f"response_format.json_schema.{key} must be {what}, got {json_type(inner[key])}",
                               f"response_format.json_schema.{key}")
    # `strict` changes nothing here: rein always enforces the whole schema (or refuses it).
    schema = inner.get("schema", {})
    if not isinstance(schema, dict):
        raise RequestError(f"response_format.json_schema.schema must be a JSON schema object, got "
                           f"{json_type(schema)}", "response_format.json_schema.schema")
    return {"type": "json_schema", "schema": schema}


def _from_structured_outputs(value: Any) -> dict[str, Any]:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise RequestError(f"{where} must be an object such as {{\"choice\": [\"yes\", \"no\"]}}, got "
                           f"{json_type(value)}", where)
    for name in value:
        if name not in _STRUCTURED_OUTPUTS_KINDS and name not in _STRUCTURED_OUTPUTS_OPTIONS:
            raise RequestError(f"{where}.{name} is not supported by rein (it takes "
                               f"{', '.join(_STRUCTURED_OUTPUTS_KINDS + _STRUCTURED_OUTPUTS_OPTIONS)}); "
                               f"remove it", f"{where}.{name}")
    kinds = [k for k in _STRUCTURED_OUTPUTS_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        given = ", ".join(kinds) or "none"
        raise RequestError(f"{where} must set exactly one of {', '.join(_STRUCTURED_OUTPUTS_KINDS)} "
                           f"(given: {given})", where)
    kind = kinds[0]
    if kind == "json_object":
        if value["json_object"] is not True:
            raise RequestError(f"{where}.json_object must be true or left out", f"{where}.json_object")
        spec: dict[str, Any] = {"type": "json_object"}
    else:
        spec = _from_guided(f"guided_{kind}", value[kind], f"{where}.{kind}")
    if value.get("disable_additional_properties") not in (None, False):
        raise RequestError(f"{where}.disable_additional_properties is not supported: put "
                           "\"additionalProperties\": false in the schema instead",
                           f"{where}.disable_additional_properties")
    if value.get("disable_fallback") is not None and not isinstance(value["disable_fallback"], bool):
        raise RequestError(f"{where}.disable_fallback must be a boolean", f"{where}.disable_fallback")
    any_ws = value.get("disable_any_whitespace")
    if any_ws is not None:
        if not isinstance(any_ws, bool):
            raise RequestError(f"{where}.disable_any_whitespace must be a boolean", f"{where}.disable_any_whitespace")
        if spec["type"] not in JSON_KINDS:
            raise RequestError(f"{where}.disable_any_whitespace only applies to json and json_object",
                               f"{where}.disable_any_whitespace")
        if not any_ws:
            spec["whitespace_flexible"] = True
    if value.get("whitespace_pattern") is not None:
        _add_whitespace_pattern(spec, value["whitespace_pattern"], f"{where}.whitespace_pattern")
    return spec


def _from_guided(name: str, value: Any, param: str | None = None) -> dict[str, Any]:
    """One vLLM constraint (guided_json, ... or structured_outputs.json, ...) as a spec."""
    param = param or name
    if name == "guided_json":
        if isinstance(value, str):
            value = _schema_from_text(value, param)
        if not isinstance(value, dict):
            raise RequestError(f"{param} must be a JSON schema object, got {json_type(value)}", param)
        return {"type": "json_schema", "schema": value}
    if name == "guided_regex":
        return {"type": "regex", "pattern": _text(value, param, "a regular expression")}
    if name == "guided_grammar":
        return {"type": "grammar", "grammar": _text(value, param, "a grammar (Lark, or GBNF/EBNF)")}
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise RequestError(f"{param} must be a non-empty list of non-empty strings", param)
        if len(value) > MAX_CHOICES:
            raise RequestError(f"{param} holds {len(value)} choices; rein takes at most {MAX_CHOICES}", param)
        return {"type": "choice", "choices": list(value)}
    raise AssertionError(name)


def _schema_from_text(text: str, param: str) -> Any:
    """A schema given as JSON text, held to the body's own rules (rein.core.input_checks.check_json:
    nesting at most MAX_JSON_DEPTH deep): text nested past Python's recursion limit makes
    json.loads raise RecursionError, a 400 here rather than a 500."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{param} is a string but not JSON ({exc.msg} at column {exc.colno}); give the "
                           "schema as an object or as JSON text", param) from None
    except RecursionError:
        raise RequestError(f"{param} is JSON text nested too deeply to read; rein takes schemas nested at most "
                           f"{MAX_JSON_DEPTH} levels deep", param) from None
    try:
        check_json(value, param)
    except BadInput as exc:
        raise RequestError(exc.message, param) from None
    return value


def _check_backend(backend: Any) -> None:
    if backend is None:
        return
    if backend not in ACCEPTED_BACKENDS:
        raise RequestError(f"guided_decoding_backend {json.dumps(backend)} is not available: rein constrains "
                           f"outputs with llguidance; leave the field out or use one of "
                           f"{', '.join(ACCEPTED_BACKENDS)}", "guided_decoding_backend")


def _add_whitespace_pattern(spec: dict[str, Any], pattern: Any, param: str) -> None:
    if spec["type"] not in JSON_KINDS:
        raise RequestError(f"{param} only applies to JSON constraints (a schema or json_object)", param)
    spec["whitespace_pattern"] = _text(pattern, param, "a regular expression")
    spec.pop("whitespace_flexible", None)


def _spec_param(source: str, spec: dict[str, Any]) -> str:
    """The parameter an error in `spec` names: the field the user wrote it in."""
    if source == "response_format":
        return "response_format.json_schema.schema" if spec["type"] == "json_schema" else "response_format"
    if source == "structured_outputs":
        kind = {"json_schema": "json", "json_object": "json_object"}.get(spec["type"], spec["type"])
        return f"structured_outputs.{kind}"
    return source


def _refuse_extra(value: dict[str, Any], allowed: set[str], where: str) -> None:
    for name in value:
        if name not in allowed:
            raise RequestError(f"{where}.{name} is not a field rein knows (it takes {', '.join(sorted(allowed))}); "
                               f"remove it", f"{where}.{name}")


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be {what} as a non-empty string, got {json_type(value)}", param)
    return value
