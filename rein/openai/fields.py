"""Reading a chat or completions body's fields: which fields a body may hold at all
(`refuse_unsupported`), and each field's value with its JSON type checked (`get_field`).
"""

from __future__ import annotations

import json
from typing import Any

from rein.core.input_checks import BadInput, check_json, json_type
from rein.openai.errors import RequestError

# Every field a body may hold. A field outside these is refused, as OpenAI refuses an
# unrecognized argument: a field rein ignored would change nothing while its sender believes
# it changed the answer (vLLM's guided_json, a misspelt temperature).
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "n", "stream", "stream_options", "logprobs", "logit_bias", "min_tokens",
    "prompt_logprobs"})
_CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "top_logprobs", "chat_template_kwargs", "response_format",
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "suffix", "best_of", "response_format"}
# Where the job runs in the queue and the engine (parsed and checked by rein.openai.priority).
_PRIORITY_FIELDS = frozenset({"priority", "service_tier"})
_CHAT_FIELDS |= _PRIORITY_FIELDS
_COMPLETION_FIELDS |= _PRIORITY_FIELDS
# OpenAI's bookkeeping fields: accepted, with no effect on the answer.
_NO_EFFECT_FIELDS = frozenset({"user", "store", "metadata", "prompt_cache_key",
                               "safety_identifier"})
# vLLM's extras, accepted when they ask for what rein does anyway (their vLLM defaults).
_NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "add_generation_prompt": (True,), "continue_final_message": (False,), "echo": (False,),
    "add_special_tokens": (False,), "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,), "use_beam_search": (False,), "best_of": (None, 1),
    "suffix": (None, ""),
}
_STRUCTURED_OUTPUT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                             "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs")


# Parsed for /v1/completions (rein.openai.choices_request); on chat, neutral values only.
_COMPLETION_CHOICE_FIELDS = frozenset({"echo", "best_of"})


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """Refuse the fields rein would otherwise ignore (they would change the answer)."""
    known = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    for name, value in body.items():
        if name in _NEUTRAL_VALUES and (chat or name not in _COMPLETION_CHOICE_FIELDS):
            # Same type and value: min_tokens=0 is neutral, min_tokens=False is a mistake.
            if any(type(value) is type(v) and value == v for v in _NEUTRAL_VALUES[name]):
                continue
            raise RequestError(f"{name}={json.dumps(value)} is not supported by rein; leave it out (rein "
                               f"behaves as {name}={json.dumps(_NEUTRAL_VALUES[name][0])})", name)
        if name in known or name in _NO_EFFECT_FIELDS:
            continue
        if name in _STRUCTURED_OUTPUT_FIELDS:
            continue   # parsed (and checked) by rein.openai.structured_fields
        where = "/v1/chat/completions" if chat else "/v1/completions"
        raise RequestError(f"Unrecognized request argument supplied: {name} (rein's {where} does not "
                           f"take it; remove it)", name)



def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
               dict: "an object"}


def get_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] checked against `kind` (null means the default); floats accept integers."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is bool and isinstance(value, bool):
            return value
        if k is int and is_int(value):
            return value
        if k is float and (isinstance(value, float) or is_int(value)):
            return float(value)
        if k not in (bool, int, float) and isinstance(value, k):
            return value
    wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
    raise RequestError(f"{name} must be {wanted}, got {json_type(value)} {json.dumps(value)[:50]}", name)




def json_from_text(text: str, param: str) -> Any:
    """The JSON value in a string field (a tool call's `arguments`), held to the rules of the body
    itself (rein.core.input_checks.check_json: nesting at most MAX_JSON_DEPTH deep, storable
    text, numbers in range). RequestError naming `param` otherwise: text nested past Python's
    recursion limit makes json.loads raise RecursionError, which is the sender's fault, not a 500."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"{param} is not valid JSON ({exc.msg} at column {exc.colno})", param) from None
    except RecursionError:
        raise RequestError(f"{param} holds JSON nested too deeply to read; flatten it", param) from None
    try:
        check_json(value, param)
    except BadInput as exc:
        raise RequestError(exc.message, param) from None
    return value
