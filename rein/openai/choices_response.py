"""The response body of a request with several choices, an echo or prompt logprobs.

`response_extra` builds what the plain one-choice body (rein.openai.response.build_response)
lacks: `choices` (one per returned choice, by index, each exactly as build_response
shapes a choice), `usage` (the prompt counted once, completion tokens summed over every
generated choice, as OpenAI bills n and best_of), and for chat vLLM's top-level
`prompt_logprobs`. The worker stores it in `results.response` and the API merges it over
the plain body (rein.worker.recorder.response_body); the offline runner merges it at once
(`full_response`). A plain request (ResponseShape.plain) gets None: nothing more is stored.

Shapes, and where they come from:

* echo (legacy completions): the choice's `text` is the prompt's text followed by the
  completion; with `logprobs` the `tokens` / `token_logprobs` / `top_logprobs` /
  `text_offset` lists cover the prompt's tokens first, the first prompt token with
  `token_logprobs` and `top_logprobs` null (it has no context) — OpenAI's documented
  behaviour, and vLLM's `request_output_to_completion_response`.
* `prompt_logprobs` (vLLM's extra): a list with one entry per prompt token, null first,
  then `{"<token id>": {"logprob", "rank", "decoded_token"}}` holding the prompt token and
  the top k alternatives (vLLM's `Logprob`). On completions it sits in each choice, on
  chat at the top level, as vLLM's CompletionResponseChoice and ChatCompletionResponse
  have it. `rank` is the token's 1-based place among the alternatives the engine returned,
  or null when it is not among them (the engine does not rank the whole vocabulary).
  -inf becomes -9999.0, as vLLM clamps it (JSON has no infinity).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from rein.engine.request_result import Choice, RequestResult
from rein.openai.endpoints import CHAT_COMPLETIONS, COMPLETIONS
from rein.openai.response import _completion_logprobs_body, _TokenTexts, build_response, usage_body
from rein.openai.response_shape import ResponseShape, returned_choices

if TYPE_CHECKING:
    from rein.engine.step_outputs import TokenLogprob

MIN_LOGPROB = -9999.0


def response_extra(endpoint: str, gathered: RequestResult, prompt_token_ids: list[int], tokenizer: Any,
                   logprobs_mode: int | None, shape: ResponseShape) -> dict[str, Any] | None:
    """The body parts beyond the plain one-choice answer (see the module docstring); None when
    the request is plain."""
    if shape.plain and len(gathered.choices) <= 1:
        return None
    texts = _TokenTexts(tokenizer)
    choices = returned_choices(gathered.ordered(), shape)
    prompt_logprobs = gathered.prompt_logprobs
    vllm_prompt_logprobs = (_vllm_prompt_logprobs(prompt_token_ids, prompt_logprobs, shape.prompt_logprobs, texts)
                            if shape.prompt_logprobs is not None else None)
    bodies = []
    for choice in choices:
        body = choice_body(endpoint, choice, tokenizer, logprobs_mode)
        if endpoint == COMPLETIONS and shape.echo is not None:
            body["text"] = shape.echo + body["text"]
            if logprobs_mode is not None:
                body["logprobs"] = _echo_logprobs(prompt_token_ids, prompt_logprobs, choice.logprobs, logprobs_mode,
                                                  tokenizer, texts)
        if endpoint == COMPLETIONS and shape.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs
        bodies.append(body)
    extra: dict[str, Any] = {
        "choices": bodies,
        "usage": usage_body(len(prompt_token_ids), gathered.completion_tokens, gathered.num_cached_tokens)}
    if endpoint == CHAT_COMPLETIONS and shape.prompt_logprobs is not None:
        extra["prompt_logprobs"] = vllm_prompt_logprobs
    return extra


def choice_body(endpoint: str, choice: Choice, tokenizer: Any, logprobs_mode: int | None) -> dict[str, Any]:
    """One choice exactly as build_response shapes choice 0, with this choice's index."""
    wants = logprobs_mode is not None
    body = build_response(endpoint, "", "", 0, choice.text, choice.token_ids, choice.finish_reason,
                          choice.logprobs if wants else None, tokenizer, logprobs_mode, created=0)["choices"][0]
    body["index"] = choice.index
    return body


def full_response(endpoint: str, request_id: str, model_name: str, gathered: RequestResult,
                  prompt_token_ids: list[int], tokenizer: Any, logprobs_mode: int | None, shape: ResponseShape,
                  created: int | None = None) -> dict[str, Any]:
    """The whole body of a finished request, any shape (the offline runner; the API's
    fallback when the stored result is late)."""
    first = returned_choices(gathered.ordered(), shape)[0]
    body = build_response(endpoint, request_id, model_name, len(prompt_token_ids), first.text, first.token_ids,
                          first.finish_reason, first.logprobs if logprobs_mode is not None else None, tokenizer,
                          logprobs_mode, created=created, cached_tokens=gathered.num_cached_tokens)
    extra = response_extra(endpoint, gathered, prompt_token_ids, tokenizer, logprobs_mode, shape)
    if extra:
        body.update(extra)
    return body


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB) if not math.isnan(logprob) else MIN_LOGPROB


def _echo_logprobs(prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None,
                   generated: list[TokenLogprob], k: int, tokenizer: Any, texts: _TokenTexts) -> dict[str, Any]:
    """Legacy completions logprobs over the prompt's tokens, then the generated ones."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for position, token_id in enumerate(prompt_token_ids):
        entry = prompt_logprobs[position] if prompt_logprobs is not None and position < len(prompt_logprobs) \
            else None
        token = texts.text(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_clamp(entry.logprob))
        # As for generated tokens: the top k alternatives, and the token itself (OpenAI: up to k + 1).
        top = {texts.text(t): _clamp(v) for t, v in entry.top[:k]}
        top.setdefault(token, _clamp(entry.logprob))
        top_logprobs.append(top)
    rest = _completion_logprobs_body(generated, tokenizer) if generated else {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    return {"tokens": tokens + rest["tokens"], "token_logprobs": token_logprobs + rest["token_logprobs"],
            "top_logprobs": top_logprobs + rest["top_logprobs"],
            "text_offset": offsets + [offset + o for o in rest["text_offset"]]}


def _vllm_prompt_logprobs(prompt_token_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None, k: int,
                          texts: _TokenTexts) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null or {token id: Logprob} (see the docstring)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for position in range(len(prompt_token_ids)):
        entry = prompt_logprobs[position] if prompt_logprobs is not None and position < len(prompt_logprobs) \
            else None
        if entry is None:
            out.append(None)
            continue
        top = entry.top[:k]
        ranks = {token_id: rank for rank, (token_id, _) in enumerate(top, start=1)}
        chosen = prompt_token_ids[position]
        item = {str(chosen): {"logprob": _clamp(entry.logprob), "rank": ranks.get(chosen),
                              "decoded_token": texts.text(chosen)}}
        for token_id, logprob in top:
            item.setdefault(str(token_id), {"logprob": _clamp(logprob), "rank": ranks[token_id],
                                            "decoded_token": texts.text(token_id)})
        out.append(item)
    return out
