"""OpenAI chat and completions requests, parsed and checked into the engine's types.

Shared by the offline batch runner and the HTTP API, so it imports no web framework and
nothing from the engine that needs torch: a request body becomes prompt token ids plus
`SamplingParams` (`parse_request`). The pieces live beside it: which fields a body may hold
and their JSON types (rein.openai.fields), the prompt (rein.openai.prompts), the choices'
fields (rein.openai.choices_request), the caps (rein.openai.limits). Each field is checked
once, here or in those modules; the engine checks only what it alone knows.

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
* n > 1, best_of, echo and vLLM's prompt_logprobs: rein.openai.choices_request parses them into
  SamplingParams and a `rein.openai.response_shape.ResponseShape`; rein.openai.choices_response builds their body.
  Each choice may use max_tokens beside the shared prompt (vLLM's context check).
* Tools (`tools`, `tool_choice`, tool messages) are read by rein.openai.tool_request and answered
  by rein.openai.tools: its docstring says what each tool_choice does and which finish_reason it gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rein.core.input_checks import json_type
from rein.engine.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_max_tokens,
    fits_context,
)
from rein.openai.choices_request import check_response_size, choice_fields
from rein.openai.endpoints import CHAT_COMPLETIONS, ENDPOINTS
from rein.openai.errors import RequestError, context_length_error
from rein.openai.fields import get_field, is_int, refuse_unsupported
from rein.openai.limits import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_CHAT_TOP_LOGPROBS,
    MAX_COMPLETION_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
)
from rein.openai.prompts import chat_prompt, check_token_ids, completion_prompt
from rein.openai.reasoning import ModelReasoning, Reasoning
from rein.openai.response_shape import ResponseShape
from rein.openai.structured_fields import structured_from_body
from rein.openai.tool_request import parse_tools, sampling_fields

if TYPE_CHECKING:
    from rein.engine.generation_defaults import GenerationDefaults


@dataclass
class ParsedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str | None
    # None: the response carries `logprobs: null`; k >= 0: logprobs with k alternatives per token.
    logprobs_mode: int | None
    stream: bool = False
    # n > 1, best_of, echo, prompt logprobs: how the choices become the body (rein.openai.response_shape).
    shape: ResponseShape = field(default_factory=ResponseShape)
    # A chat request to a model with a reasoning parser (rein.openai.reasoning); None: no parser.
    reasoning: Reasoning | None = None


def parse_request(endpoint: str, body: dict[str, Any], tokenizer: Any, max_model_len: int,
                  defaults: GenerationDefaults | None = None, tool_parser: str | None = None,
                  reasoning: ModelReasoning | None = None, chat_token_ids: list[int] | None = None) -> ParsedRequest:
    """Turn one OpenAI request body into prompt token ids and sampling params.

    `defaults` (the model's generation_config.json, rein.engine.generation_defaults) fill the
    sampling fields the body leaves out (or sets to null); without them, rein's built-in ones.
    `tool_parser`: the format of auto tool answers (rein.openai.tool_call_parsers; None: hermes).
    `reasoning`: the model's reasoning parser (chat only): the answer's thinking is split out,
    and a structured output applies after it. `chat_token_ids`: a chat body's prompt already
    rendered and expanded (its images' tokens: rein.model.vision.processor), used as it is.
    """
    default = defaults.get if defaults is not None else (lambda _name, builtin: builtin)
    if endpoint not in ENDPOINTS:
        raise RequestError(f"unknown endpoint {endpoint!r}: use {' or '.join(ENDPOINTS)}", "url")
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    chat = endpoint == CHAT_COMPLETIONS
    refuse_unsupported(body, chat)
    model = get_field(body, "model", str)
    stream = bool(get_field(body, "stream", bool, False))
    include_usage = get_field(body, "stream_options", dict, {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise RequestError(f"stream_options.include_usage must be a boolean, got {json_type(include_usage)}",
                           "stream_options.include_usage")

    tool_request = parse_tools(body, tool_parser) if chat else None
    if chat:
        prompt = chat_token_ids if chat_token_ids is not None else \
            chat_prompt(body, tokenizer, max_model_len, tool_request)
        logprobs_mode = _chat_logprobs(body)
    else:
        prompt = completion_prompt(body, tokenizer, max_model_len)
        check_token_ids(prompt, tokenizer, "prompt")
        logprobs_mode = get_field(body, "logprobs", int)
        if logprobs_mode is not None and not 0 <= logprobs_mode <= MAX_COMPLETION_LOGPROBS:
            raise RequestError(f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs_mode}",
                               "logprobs")

    if stream and logprobs_mode is not None:
        # Stream chunks carry text only; refused rather than answered with logprobs: null.
        raise RequestError("logprobs are not streamed: leave out stream, or logprobs (the job's result at "
                           "GET /v1/jobs/{id} holds them)", "top_logprobs" if chat and body.get("top_logprobs")
                           is not None else "logprobs")
    max_tokens, max_tokens_param = _max_tokens(body, len(prompt), max_model_len, chat)

    choices, shape = choice_fields(body, chat, stream, prompt, tokenizer, logprobs_mode)
    check_response_size(shape, len(prompt), max_tokens, logprobs_mode, choices.get("prompt_logprobs"),
                        max_tokens_param, chat)
    stop = get_field(body, "stop", (str, list))
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        raise RequestError("stop must be a string or a list of strings", "stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise RequestError(f"stop holds at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} "
                           f"characters each (got {len(stops)}, the longest {max(map(len, stops))} characters)",
                           "stop")
    stop_token_ids = get_field(body, "stop_token_ids", list, [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_token_ids)}",
                           "stop_token_ids")
    if not all(is_int(t) for t in stop_token_ids):
        raise RequestError("stop_token_ids must be a list of integers", "stop_token_ids")
    check_token_ids(stop_token_ids, tokenizer, "stop_token_ids")
    repetition_penalty = get_field(body, "repetition_penalty", float, default("repetition_penalty", 1.0))
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        raise RequestError(f"repetition_penalty must be between {MIN_REPETITION_PENALTY} and "
                           f"{MAX_REPETITION_PENALTY} (1 means none), got {repetition_penalty}",
                           "repetition_penalty")

    fields = {
        "max_tokens": max_tokens,
        "temperature": get_field(body, "temperature", float, default("temperature", 1.0)),
        "top_p": get_field(body, "top_p", float, default("top_p", 1.0)),
        "top_k": get_field(body, "top_k", int, default("top_k", 0)),
        "min_p": get_field(body, "min_p", float, default("min_p", 0.0)),
        "presence_penalty": get_field(body, "presence_penalty", float, 0.0),
        "frequency_penalty": get_field(body, "frequency_penalty", float, 0.0),
        "repetition_penalty": repetition_penalty,
        "seed": get_field(body, "seed", int),
        "logprobs": logprobs_mode,
        "stop": stop or [],
        "stop_token_ids": stop_token_ids,
        "ignore_eos": get_field(body, "ignore_eos", bool, False),
        "skip_special_tokens": get_field(body, "skip_special_tokens", bool,
                                         not (tool_request is not None and tool_request.keeps_special_tokens)),
        **choices,
        "structured": structured_from_body(body),
    }
    if tool_request is not None:   # after any response_format's fields["structured"]: the two conflict
        sampling_fields(fields, tool_request)
    request_reasoning = reasoning.for_prompt(prompt) if chat and reasoning is not None else None
    if fields["structured"] is not None and request_reasoning is not None and not request_reasoning.ended_in_prompt:
        fields["structured_after_token_id"] = request_reasoning.end_token_id   # the answer after the thinking
    try:
        params = SamplingParams(**fields)
    except SamplingParamsError as exc:   # max_tokens never: _max_tokens checked it
        param = "top_logprobs" if chat and exc.param == "logprobs" else exc.param
        raise RequestError(str(exc), param) from exc
    return ParsedRequest(prompt, params, model, logprobs_mode, stream, shape, request_reasoning)


def _max_tokens(body: dict[str, Any], prompt_tokens: int, max_model_len: int, chat: bool) -> tuple[int, str]:
    """The completion's token budget and the field that gave it: the one check of max_tokens and
    max_completion_tokens. Both are checked, though max_completion_tokens wins when both are
    given. (The engine, which owns the context, checks prompt + max_tokens again when a request
    reaches it, in its own words: rein.engine.errors.ContextLengthExceeded.)"""
    for name in ("max_tokens", "max_completion_tokens"):
        value = get_field(body, name, int)
        try:
            if value is not None:
                check_max_tokens(value, name)
        except SamplingParamsError as exc:
            raise RequestError(str(exc), exc.param) from None
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_field(body, param, int)
    if max_tokens is None:
        max_tokens = max(max_model_len - prompt_tokens, 1) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    if not fits_context(prompt_tokens, max_tokens, max_model_len):
        raise context_length_error(max_model_len, prompt_tokens, max_tokens, chat)
    return max_tokens, param


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = get_field(body, "logprobs", bool, False)
    top = get_field(body, "top_logprobs", int)
    if top is not None:
        if not wanted:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got {top}",
                               "top_logprobs")
    return (top or 0) if wanted else None

