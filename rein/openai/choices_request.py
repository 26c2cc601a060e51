"""n, best_of, logit_bias, min_tokens, echo and prompt_logprobs of a request: the SamplingParams
fields they set and the response's shape (rein.openai.response_shape.ResponseShape), and the caps on
how much one response may repeat (`check_response_size`).
"""

from __future__ import annotations

import json
from typing import Any

from rein.engine.sampling_params import MAX_LOGIT_BIAS, MAX_N
from rein.openai.errors import RequestError
from rein.openai.fields import get_field
from rein.openai.limits import (
    MAX_CHAT_TOP_LOGPROBS,
    MAX_ECHOED_PROMPT_ENTRIES,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_LOGPROB_ENTRIES,
)
from rein.openai.response_shape import ResponseShape


def check_response_size(shape: ResponseShape, prompt_tokens: int, max_tokens: int, logprobs: int | None,
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



def choice_fields(body: dict[str, Any], chat: bool, stream: bool, prompt: list[int], tokenizer: Any,
                   logprobs_mode: int | None) -> tuple[dict[str, Any], ResponseShape]:
    """n, best_of, logit_bias, min_tokens, echo and prompt_logprobs: SamplingParams fields
    and the response's shape (rein.openai.response_shape.ResponseShape)."""
    n = get_field(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"n must be between 1 and {MAX_N}, got {n}", "n")
    generated = n
    best_of = None if chat else get_field(body, "best_of", int)
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
    bias = get_field(body, "logit_bias", dict)
    if bias:
        fields["logit_bias"] = _logit_bias(bias, tokenizer)
    min_tokens = get_field(body, "min_tokens", int, 0)
    if min_tokens < 0:
        raise RequestError(f"min_tokens must be at least 0, got {min_tokens}", "min_tokens")
    fields["min_tokens"] = min_tokens
    prompt_logprobs = get_field(body, "prompt_logprobs", int)
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_CHAT_TOP_LOGPROBS:
            raise RequestError(f"prompt_logprobs must be between 0 and {MAX_CHAT_TOP_LOGPROBS}, got "
                               f"{prompt_logprobs}", "prompt_logprobs")
        if stream:
            raise RequestError("prompt_logprobs are not streamed: leave out stream, or prompt_logprobs",
                               "prompt_logprobs")
    echo = None
    if not chat and get_field(body, "echo", bool, False):
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

