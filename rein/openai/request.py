"""OpenAI request and response shapes, mapped onto the engine's types.

Shared by the offline batch runner and the HTTP API, so it imports no web framework and
nothing from the engine that needs torch: a request body becomes prompt token ids plus
`SamplingParams`, and the engine's text, token ids and logprobs become exactly the body
OpenAI's `chat.completion` or `text_completion` would have. Batch-file lines (the OpenAI
Batch API's `{"custom_id", "method", "url", "body"}`) are read and written here too.

Every malformed request raises `RequestError`, whose message says what was wrong and
whose `param` and `code` fill OpenAI's error object.

Choices made where OpenAI is silent or rein differs:

* Default `max_tokens`: 16 for /v1/completions (OpenAI's), the rest of the context
  (max_model_len - prompt tokens) for /v1/chat/completions (vLLM's).
* `max_completion_tokens` wins over `max_tokens` when both are given.
* A completions prompt string is encoded with the tokenizer's special tokens (BOS), as
  vLLM does; chat prompts come from the chat template alone.
* finish_reason "abort" (the request was cancelled or the engine stopped) is not an
  OpenAI value. Callers should report an aborted request as an error (the batch runner
  writes an error line); if a response is built anyway it says "length": the text was cut
  short from outside, which clients treat as "incomplete", whereas "stop" would claim the
  model ended its answer.
* Completions `text_offset` counts characters from the start of the returned text, token
  by token (with `echo`, from the start of the prompt's tokens).
* n > 1, best_of, echo and vLLM's prompt_logprobs: `_choice_fields` parses them into
  SamplingParams and a `rein.openai.choices.ResponseShape`; rein.openai.choice_bodies builds their body.
  Each choice may use max_tokens beside the shared prompt (vLLM's context check).
* Tools (`tools`, `tool_choice`, tool messages) are read and answered by rein.openai.tools: its
  docstring says what each tool_choice does and which finish_reason it gives.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rein.core.input_checks import json_type
from rein.engine.sampling_params import MAX_LOGIT_BIAS, MAX_N, SamplingParams, SamplingParamsError
from rein.openai import tools
from rein.openai.choices import ResponseShape
from rein.openai.endpoints import (
    CHAT_COMPLETIONS,
    ENDPOINTS,
)
from rein.openai.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    RequestError,
    context_length_error,
)

if TYPE_CHECKING:
    from rein.engine.generation_defaults import GenerationDefaults


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# vLLM's range. Past it the penalty scales float32 logits to infinity (or to zero).
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 2.0
# Caps on what a request may hold, checked before the costly work (tokenizing, templating):
# far beyond what a real request needs, small enough that no request can hog the API.
MAX_MESSAGES = 1024
MAX_CHARS_PER_TOKEN = 64          # a prompt longer than context x this cannot fit in any tokenizer
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256






@dataclass
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str | None
    # None: the response carries `logprobs: null`; k >= 0: logprobs with k alternatives per token.
    logprobs_mode: int | None
    stream: bool = False
    # n > 1, best_of, echo, prompt logprobs: how the choices become the body (rein.openai.choices).
    shape: ResponseShape = field(default_factory=ResponseShape)




# -- requests ---------------------------------------------------------------------------------


def parse_request(endpoint: str, body: dict[str, Any], tokenizer: Any, max_model_len: int,
                  defaults: GenerationDefaults | None = None) -> ParsedRequest:
    """Turn one OpenAI request body into prompt token ids and sampling params.

    `defaults` (the model's generation_config.json, rein.engine.generation_defaults) fill the
    sampling fields the body leaves out (or sets to null); without them, rein's built-in ones.
    """
    default = defaults.get if defaults is not None else (lambda _name, builtin: builtin)
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unknown endpoint {endpoint!r}: use {' or '.join(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    chat = endpoint == CHAT_COMPLETIONS
    _refuse_unsupported(body, chat)
    model = _get(body, "model", str)
    stream = bool(_get(body, "stream", bool, False))
    include_usage = _get(body, "stream_options", dict, {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError(f"stream_options.include_usage must be a boolean, got {json_type(include_usage)}",
                           "stream_options.include_usage")

    tool_request = tools.parse_tools(body) if chat else None
    if chat:
        prompt = chat_prompt(body, tokenizer, max_model_len, tool_request)
        logprobs_mode = _chat_logprobs(body)
    else:
        prompt = _completion_prompt(body, tokenizer, max_model_len)
        _check_token_ids(prompt, tokenizer, "prompt")
        logprobs_mode = _get(body, "logprobs", int)
        if logprobs_mode is not None and not 0 <= logprobs_mode <= MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs_mode}",
                               "logprobs")

    if stream and logprobs_mode is not None:
        # Stream chunks carry text only; refused rather than answered with logprobs: null.
        raise RequestError("logprobs are not streamed: leave out stream, or logprobs (the job's result at "
                           "GET /v1/jobs/{id} holds them)", "top_logprobs" if chat and body.get("top_logprobs")
                           is not None else "logprobs")
    for name in ("max_tokens", "max_completion_tokens"):   # both checked, though one wins
        value = _get(body, name, int)
        if value is not None and value < 1:
            raise RequestError(f"{name} must be at least 1, got {value}", name)
    max_tokens_param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, max_tokens_param, int)
    if max_tokens is None:
        max_tokens = max(max_model_len - len(prompt), 1) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if len(prompt) + max_tokens > max_model_len:
        raise context_length_error(max_model_len, len(prompt), max_tokens, chat)

    choice_fields, shape = _choice_fields(body, chat, stream, prompt, tokenizer, logprobs_mode)
    _check_response_size(shape, len(prompt), max_tokens, logprobs_mode, choice_fields.get("prompt_logprobs"),
                         max_tokens_param, chat)
    stop = _get(body, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise RequestError(f"stop holds at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                           f"characters each (got {len(stops)}, the longest {max(map(len, stops))} characters)",
                           "stop")
    stop_token_ids = _get(body, "stop_token_ids", list, [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}",
                           "stop_token_ids")
    if not all(_is_int(t) for t in stop_token_ids):
        raise RequestError("stop_token_ids must be a list of integers", "stop_token_ids")
    _check_token_ids(stop_token_ids, tokenizer, "stop_token_ids")
    repetition_penalty = _get(body, "repetition_penalty", float, default("repetition_penalty", 1.0))
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise RequestError(f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and "
                           f"{MAX_REPETITION_PENALTY} (1 means none), got {repetition_penalty}",
                           "repetition_penalty")

    fields = {
        "max_tokens": max_tokens,
        "temperature": _get(body, "temperature", float, default("temperature", 1.0)),
        "top_p": _get(body, "top_p", float, default("top_p", 1.0)),
        "top_k": _get(body, "top_k", int, default("top_k", 0)),
        "min_p": _get(body, "min_p", float, default("min_p", 0.0)),
        "presence_penalty": _get(body, "presence_penalty", float, 0.0),
        "frequency_penalty": _get(body, "frequency_penalty", float, 0.0),
        "repetition_penalty": repetition_penalty,
        "seed": _get(body, "seed", int),
        "logprobs": logprobs_mode,
        "stop": stop or [],
        "stop_token_ids": stop_token_ids,
        "ignore_eos": _get(body, "ignore_eos", bool, False),
        "skip_special_tokens": _get(body, "skip_special_tokens", bool, True),
        **choice_fields,
        "structured": _structured(body),
    }
    if tool_request is not None:   # after any response_format's fields["structured"]: the two conflict
        tools.sampling_fields(fields, tool_request)
    try:
        params = SamplingParams(**fields)
    except SamplingParamsError as exc:
        param = max_tokens_param if exc.param == "max_tokens" else exc.param
        if chat and exc.param == "logprobs":
            param = "top_logprobs"
        raise RequestError(str(exc), param) from exc
    return ParsedRequest(prompt, params, model, logprobs_mode, stream, shape)


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    # Imported here: rein.engine.structured.request raises this module's RequestError.
    from rein.engine.structured.request import structured_from_body

    return structured_from_body(body)




# What one response may repeat: every returned choice carries the echoed prompt and its logprobs,
# and its own token logprobs with their alternatives (a 1,024-token prompt, n=4 and
# prompt_logprobs=20 made 6.7 MB of JSON; n=128 on an 8K prompt would be gigabytes). Counted
# in entries (a token with its logprob, or one alternative), about 80 bytes of JSON each.
MAX_ECHOED_PROMPT_ENTRIES = 262_144
MAX_LOGPROB_ENTRIES = 1_048_576


def _check_response_size(shape: ResponseShape, prompt_tokens: int, max_tokens: int, logprobs: int | None,
                         prompt_alternatives: int | None, max_tokens_param: str, chat: bool) -> None:
    """Refuse, up front, a request whose response would repeat more than the caps above."""
    if shape.echo is not None or shape.prompt_logprobs is not None:
        entries = shape.n * prompt_tokens * (1 + (prompt_alternatives or 0))
        if entries > MAX_ECHOED_PROMPT_ENTRIES:
            param = "prompt_logprobs" if shape.prompt_logprobs is not None else "echo"
            raise RequestError(
                f"the response would repeat the prompt's {prompt_tokens} tokens in each of {shape.n} choices with "
                f"{prompt_alternatives or 0} alternatives each: {entries} entries, past rein's cap of "
                f"{MAX_ECHOED_PROMPT_ENTRIES}; lower n or prompt_logprobs, or shorten the prompt", param)
    if logprobs is not None:
        entries = shape.n * max_tokens * (1 + logprobs)
        if entries > MAX_LOGPROB_ENTRIES:
            name = "top_logprobs" if chat else "logprobs"
            raise RequestError(
                f"the response could hold {entries} logprob entries ({shape.n} choices x {max_tokens} tokens x "
                f"{1 + logprobs}), past rein's cap of {MAX_LOGPROB_ENTRIES}; lower n, {max_tokens_param} or "
                f"{name}", name)


MAX_LOGIT_BIAS_TOKENS = 1024   # rein's cap on a logit_bias map: far more tokens than a real request biases


def _choice_fields(body: dict[str, Any], chat: bool, stream: bool, prompt: list[int], tokenizer: Any,
                   logprobs_mode: int | None) -> tuple[dict[str, Any], ResponseShape]:
    """n, best_of, logit_bias, min_tokens, echo and prompt_logprobs: SamplingParams fields
    and the response's shape (rein.openai.choices.ResponseShape)."""
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, got {n}", "n")
    generated = n
    best_of = None if chat else _get(body, "best_of", int)
    if best_of is not None:
        if not n <= best_of <= MAX_N:
            raise RequestError(f"best_of must be between n ({n}) and {MAX_N}, got {best_of}", "best_of")
        if stream and best_of != n:
            raise RequestError("best_of cannot be streamed (the choices returned are known only at the end): "
                               "leave out stream, or best_of", "best_of")
        generated = best_of
    fields: dict[str, Any] = {"n": generated}
    if best_of is not None and best_of > n and logprobs_mode is None:
        fields["logprobs"] = 0     # best_of ranks choices by cumulative logprob; not returned unasked
    bias = _get(body, "logit_bias", dict)
    if bias:
        fields["logit_bias"] = _logit_bias(bias, tokenizer)
    min_tokens = _get(body, "min_tokens", int, 0)
    if min_tokens < 0:
        raise RequestError(f"min_tokens must be at least 0, got {min_tokens}", "min_tokens")
    fields["min_tokens"] = min_tokens
    prompt_logprobs = _get(body, "prompt_logprobs", int)
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got "
                               f"{prompt_logprobs}", "prompt_logprobs")
        if stream:
            raise RequestError("prompt_logprobs are not streamed: leave out stream, or prompt_logprobs",
                               "prompt_logprobs")
    echo = None
    if not chat and _get(body, "echo", bool, False):
        raw = body["prompt"]
        raw = raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else raw
        echo = raw if isinstance(raw, str) else tokenizer.decode(prompt)
    # The engine computes prompt logprobs once, with as many alternatives as either use needs.
    wanted = [k for k in (prompt_logprobs, logprobs_mode if echo is not None else None) if k is not None]
    if wanted:
        fields["prompt_logprobs"] = max(wanted)
    return fields, ResponseShape(n=n, echo=echo, prompt_logprobs=prompt_logprobs, best_of=best_of)


def _logit_bias(bias: dict[str, Any], tokenizer: Any) -> dict[int, float]:
    """OpenAI's logit_bias: token id (a JSON key, so a string) -> a bias between -100 and 100."""
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}", "logit_bias")
    try:
        vocab_size: int | None = len(tokenizer)
    except TypeError:
        vocab_size = None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token_id = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        if token_id is None or (vocab_size is not None and token_id >= vocab_size):
            ids = f"0 to {vocab_size - 1}" if vocab_size is not None else "non-negative integers"
            raise RequestError(f"logit_bias: {json.dumps(key)} is not a token id of this model: token ids run "
                               f"from {ids} (the keys are token ids as strings, e.g. \"50256\")", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias[{json.dumps(key)}] must be a number between -{MAX_LOGIT_BIAS:g} and "
                               f"{MAX_LOGIT_BIAS:g}, got {json.dumps(value)[:50]}", "logit_bias")
        out[token_id] = float(value)
    return out


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
# OpenAI's bookkeeping fields: accepted, with no effect on the answer.
_NO_EFFECT_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key",
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


# Parsed for /v1/completions (rein.openai.request._choice_fields); on chat, neutral values only.
_COMPLETION_CHOICE_FIELDS = frozenset({"echo", "best_of"})


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
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
            continue   # parsed (and checked) by rein.engine.structured.request
        where = "/v1/chat/completions" if chat else "/v1/completions"
        raise RequestError(f"Unrecognized request argument supplied: {name} (rein's {where} does not "
                           f"take it; remove it)", name)


def chat_prompt(body: dict[str, Any], tokenizer: Any, max_model_len: int,
                tool_request: tools.ToolRequest | None = None) -> list[int]:
    """The prompt token ids of a chat body's messages, through the model's chat template (the API,
    batch files and `rein.LLM.chat` all build chat prompts here). The body's tools go to the
    template (rein.openai.tools; `tool_request`: parse_tools(body) when the caller has it already)."""
    if "messages" not in body:
        raise RequestError("'messages' is a required property", "messages")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise RequestError(f"messages holds at most {MAX_MESSAGES} messages, got {len(messages)}", "messages")
    if tool_request is None:
        tool_request = tools.parse_tools(body)
    plain = [_plain_message(m, i) for i, m in enumerate(messages)]
    _check_prompt_chars(sum(len(m["content"]) for m in plain) + tools.template_chars(plain, tool_request),
                        max_model_len, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions with a prompt",
                           "messages")
    tools.check_template(tokenizer.chat_template, tool_request)
    template_kwargs = _chat_template_kwargs(body, tokenizer)
    if tool_request is not None and tool_request.template_tools is not None:
        template_kwargs["tools"] = tool_request.template_tools
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **template_kwargs)
    except Exception as exc:  # the template may raise anything (jinja errors, raise_exception)
        raise RequestError(f"the model's chat template rejected the messages: {exc}", "messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding despite return_dict=False
        ids = ids["input_ids"]
    ids = [int(t) for t in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if not ids:
        raise RequestError("the messages produced an empty prompt", "messages")
    return ids


# apply_chat_template's own arguments: chat_template_kwargs may not set them.
_TEMPLATE_RESERVED = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})
# What a template reads but a request may not change: the special tokens (transformers passes
# them as variables, and a request's variables would win: eos_token overridden could make the
# prompt end a turn the model never sees end) and the helpers transformers provides.
_TEMPLATE_PROTECTED = frozenset({"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                                 "mask_token", "additional_special_tokens", "raise_exception", "strftime_now"})


def _chat_template_kwargs(body: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: extra variables for the template (e.g. enable_thinking)."""
    kwargs = _get(body, "chat_template_kwargs", dict, {})
    special = set(getattr(tokenizer, "special_tokens_map", None) or {})
    for name in kwargs:
        if not name.isidentifier() or name in _TEMPLATE_RESERVED:
            raise RequestError(f"chat_template_kwargs may not set {name!r}: it names the template's variables "
                               f"(e.g. enable_thinking), not apply_chat_template's own arguments",
                               f"chat_template_kwargs.{name}")
        if name in _TEMPLATE_PROTECTED or name in special or name.startswith("_"):
            raise RequestError(f"chat_template_kwargs may not set {name!r}: the template takes it from the "
                               f"model (its special tokens and helpers), not from a request",
                               f"chat_template_kwargs.{name}")
    return kwargs


def _plain_message(message: Any, index: int) -> dict[str, Any]:
    """{role, content} with content as one string (text parts joined), plus what the template
    needs of tool calls and tool results (rein.openai.tools.template_message_fields)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content, got {json_type(message)}", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                           f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise RequestError(f"{where}.content: only text parts are supported, got {kind!r}",
                                   f"{where}.content")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content: a text part needs its text as a string, got "
                                   f"{json_type(part.get('text'))}", f"{where}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts, got {json_type(content)}",
                           f"{where}.content")
    return {"role": role, "content": content, **tools.template_message_fields(message, role, where)}


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = _get(body, "logprobs", bool, False)
    top = _get(body, "top_logprobs", int)
    if top is not None:
        if not wanted:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got {top}",
                               "top_logprobs")
    return (top or 0) if wanted else None


def _check_prompt_chars(chars: int, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing it, a text too long for the context whatever the tokenizer."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise RequestError(f"The {param} ({chars} characters) are far longer than this model's context of "
                           f"{max_model_len} tokens can take: at most {limit} characters are tokenized. "
                           f"Shorten them.", param, CONTEXT_LENGTH_EXCEEDED)


def _completion_prompt(body: dict[str, Any], tokenizer: Any, max_model_len: int) -> list[int]:
    if "prompt" not in body:
        raise RequestError("'prompt' is a required property", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise RequestError(
                f"the prompt is a list of {len(prompt)} prompts; rein takes one prompt per request: "
                f"send each as its own request (one batch line each)", "prompt")
        prompt = prompt[0]
    if prompt == "":   # refused whatever the tokenizer adds (a BOS) to it: it asks for nothing
        raise RequestError("the prompt is empty: give at least one character or token", "prompt")
    if isinstance(prompt, str):
        _check_prompt_chars(len(prompt), max_model_len, "prompt")
        ids = list(tokenizer.encode(prompt, add_special_tokens=True))
    elif isinstance(prompt, list) and all(_is_int(t) and t >= 0 for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError("prompt must be a string or a list of token ids (non-negative integers)", "prompt")
    if not ids:
        raise RequestError("the prompt is empty: give at least one token", "prompt")
    return ids


def _check_token_ids(ids: list[int], tokenizer: Any, param: str) -> None:
    """Token ids must name tokens of the model's vocabulary: any other id is out of range of
    the embedding (and of the int4 column prompts are stored in)."""
    try:
        vocab_size = len(tokenizer)
    except TypeError:   # a tokenizer that cannot tell: nothing to check against
        return
    for index, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            where = f"{param}[{index}]"
            raise RequestError(f"{where} is {token_id}, not a token id of this model: ids run from 0 to "
                               f"{vocab_size - 1} (the tokenizer's vocabulary size is {vocab_size})", param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "a list",
               dict: "an object"}


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """body[name] checked against `kind` (null means the default); floats accept integers."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    for k in kinds:
        if k is bool and isinstance(value, bool):
            return value
        if k is int and _is_int(value):
            return value
        if k is float and (isinstance(value, float) or _is_int(value)):
            return float(value)
        if k not in (bool, int, float) and isinstance(value, k):
            return value
    wanted = " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)
    raise RequestError(f"{name} must be {wanted}, got {json_type(value)} {json.dumps(value)[:50]}", name)




# -- responses --------------------------------------------------------------------------------






















# -- batch lines ------------------------------------------------------------------------------








