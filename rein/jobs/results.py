"""A finished job's response body, from its row and its stored result: what the API, the batch output and the worker share."""

from __future__ import annotations

from typing import Any

from rein.core.priorities import is_interactive
from rein.openai.embeddings import job_embeddings_body
from rein.openai.endpoints import EMBEDDINGS, RESPONSES, generated_as
from rein.openai.reasoning import Reasoning, apply_reasoning
from rein.openai.response import build_response
from rein.openai.responses import chat_body
from rein.openai.responses_body import response_from_chat
from rein.openai.tools import apply_tool_calls
from rein.store.tables import Job, Result


def response_body(job: Job, result: Result, cached_tokens: int = 0,
                  reasoning_tokens: int | None = None) -> dict[str, Any]:
    """The OpenAI body of a finished job, exactly as the synchronous endpoint returns it.

    `created` is the job's finish time; the id is the job id with OpenAI's prefix;
    `cached_tokens` and `reasoning_tokens` come from the job's usage row (reasoning_tokens None:
    counted from the stored token ids, the first choice's).
    """
    if job.endpoint == EMBEDDINGS:
        return job_embeddings_body(job, result.response)
    finished = job.finished_at or result.created_at
    body = build_response(generated_as(job.endpoint), job.id, job.model, job.prompt_tokens, result.text,
                          list(result.token_ids), result.finish_reason, None, None, None,
                          created=int(finished.timestamp()) if finished is not None else None,
                          cached_tokens=cached_tokens)
    body["choices"][0]["logprobs"] = result.logprobs
    if result.response:   # n > 1, echo, prompt logprobs: the choices and usage the worker built
        body.update(result.response)
    params = job.params or {}
    # The thinking split out of the answer first: tool calls are parsed from what follows it.
    body = apply_reasoning(body, Reasoning.from_dict(params.get("reasoning")), [list(result.token_ids)],
                           reasoning_tokens)
    request, parser = params.get("body"), params.get("tool_parser")   # the tool call format stored at submission
    if job.endpoint == RESPONSES:   # the chat body it ran as, then the `response` (rein.openai.responses)
        created = job.created_at or finished
        return response_from_chat(apply_tool_calls(body, chat_body(request), parser), request, job.id,
                                  created_at=int(created.timestamp()) if created is not None else None)
    body = apply_tool_calls(body, request, parser)   # tool calls out of the text (rein.openai.tools)
    return with_service_tier(body, request, job.priority)


def with_service_tier(body: dict[str, Any], request: Any, priority: int) -> dict[str, Any]:
    """`body` naming the service tier that ran it, as OpenAI's do, when the request named one
    (rein.openai.priority): "flex" for batch-class work, else "default"."""
    if isinstance(request, dict) and request.get("service_tier") is not None:
        body["service_tier"] = "default" if is_interactive(priority) else "flex"
    return body


def response_logprobs(endpoint: str, logprobs: list[Any] | None, tokenizer: Any,
                      logprobs_mode: int | None) -> dict[str, Any] | None:
    """The response's `logprobs` object for the engine's per-token logprobs (None if not asked)."""
    if logprobs_mode is None or logprobs is None:
        return None
    token_ids = [lp.token_id for lp in logprobs]
    body = build_response(endpoint, "", "", 0, "", token_ids, None, logprobs, tokenizer, logprobs_mode,
                          created=0)
    return body["choices"][0]["logprobs"]
