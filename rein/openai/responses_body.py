"""The `response` object of the Responses API (rein.openai.responses), built from the finished
chat.completion body a Responses request ran as, and its output items and usage, which the
streamed events (rein.openai.responses_stream) share, so streamed and stored answers agree.

Ids derive from the job id (`resp_`, `msg_`, `rs_` + its id; `fc_` + the tool call's id), so a
body rebuilt from Postgres for every GET /v1/jobs/{id} and batch output view is the same.

Torch-free: the API imports it.
"""

from __future__ import annotations

import time
from typing import Any


def response_id(job_id: str) -> str:
    return job_id if job_id.startswith("resp_") else "resp_" + job_id


def response_from_chat(chat: dict[str, Any], request: dict[str, Any], job_id: str,
                       created_at: float | None = None) -> dict[str, Any]:
    """The `response` object of a finished chat.completion body (tool calls already parsed
    out of its text) for the Responses `request` it ran; completed when the chat body was
    made (its `created`), created at `created_at` (default: then too)."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    finish = choice.get("finish_reason")
    items = output_items(job_id, message.get("reasoning_content"), message.get("content"),
                         message.get("tool_calls") or [], request, finish)
    return response_object(request, job_id, chat.get("model") or request.get("model"), items,
                           status="incomplete" if finish == "length" else "completed",
                           usage=responses_usage(chat.get("usage")),
                           created_at=chat.get("created") if created_at is None else created_at,
                           completed_at=chat.get("created"))


def output_items(job_id: str, reasoning: str | None, content: str | None, tool_calls: list[dict[str, Any]],
                 request: dict[str, Any], finish: str | None) -> list[dict[str, Any]]:
    """The output items, in order: reasoning, the message (when it has text, or when there are
    no calls: an empty answer is still a message), then one function_call per call."""
    status = "incomplete" if finish == "length" else "completed"
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(job_id, reasoning, request, status))
    if content or not tool_calls:
        items.append(message_item(job_id, content or "", status))
    for call in tool_calls:
        function = call.get("function") or {}
        items.append(function_call_item(call.get("id") or "", function.get("name") or "",
                                        function.get("arguments") or "", status))
    return items


def reasoning_item(job_id: str, text: str, request: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    wants_summary = bool((request.get("reasoning") or {}).get("summary")
                         or (request.get("reasoning") or {}).get("generate_summary"))
    return {"id": "rs_" + _bare(job_id), "type": "reasoning",
            "summary": [{"type": "summary_text", "text": text}] if wants_summary else [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(job_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": "msg_" + _bare(job_id), "type": "message", "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def responses_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    """Chat usage in Responses' names; reasoning_tokens from completion_tokens_details when
    the model's reasoning parser counted them."""
    usage = chat_usage or {}
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def response_object(request: dict[str, Any], job_id: str, model: str | None, output: list[dict[str, Any]], *,
                    status: str, usage: dict[str, Any] | None, created_at: float | None = None,
                    completed_at: float | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `response` object: the request's settings echoed, with this output, status and usage
    (`completed_at`, for a completed one: default now)."""
    created_at = int(time.time()) if created_at is None else created_at
    if status == "completed" and completed_at is None:
        completed_at = int(time.time())
    text_format = (request.get("text") or {}).get("format") or {"type": "text"}
    tools = [{"type": "function", "name": tool.get("name"), "description": tool.get("description"),
              "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}
             for tool in request.get("tools") or []]
    reasoning = request.get("reasoning")
    finished = status in ("completed", "incomplete", "failed")
    return {
        "id": response_id(job_id), "object": "response", "created_at": created_at, "status": status,
        "completed_at": completed_at if status == "completed" else None,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": None, "model": model, "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True), "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")} if reasoning else None,
        "store": request.get("store", True), "temperature": request.get("temperature"),
        "text": {"format": text_format}, "tool_choice": request.get("tool_choice", "auto"), "tools": tools,
        "top_p": request.get("top_p"), "truncation": "disabled", "usage": usage if finished else None,
        "user": request.get("user"), "metadata": request.get("metadata") or {},
    }


def _bare(job_id: str) -> str:
    return job_id.removeprefix("resp_").removeprefix("job_")


