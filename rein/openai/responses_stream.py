"""Streamed Responses: chat.completion.chunk bodies in, Responses' SSE events out.

A streamed `/v1/responses` request runs as a streamed chat request, so everything the chat
stream does (tool calls parsed as the text streams, reasoning split from the answer where
the model has a reasoning parser) reaches the Responses events too. `ResponsesStream` reads
each chunk's delta and emits, with increasing `sequence_number`s:

  response.created, response.in_progress
  per output item: response.output_item.added, then
    reasoning:     response.content_part.added, response.reasoning_text.delta ...,
                   response.reasoning_text.done, response.content_part.done (and the
                   response.reasoning_summary_* events when a summary was asked)
    message:       response.content_part.added, response.output_text.delta ...,
                   response.output_text.done, response.content_part.done
    function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
  response.output_item.done
  response.completed | response.incomplete (cut at max_output_tokens) | response.failed

The final response object is built by the same functions as the non-streamed one
(rein.openai.responses), so the two agree.

Torch-free: the API imports it.
"""

from __future__ import annotations

import json
from typing import Any

from rein.openai.responses_body import (
    function_call_item,
    message_item,
    output_text_part,
    reasoning_item,
    response_object,
    responses_usage,
)


def sse_event(event: dict[str, Any]) -> str:
    """One Responses event as SSE: `event: <type>` and its JSON."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponsesStream:
    """One streamed response's events, from its chat chunks (see the module docstring)."""

    def __init__(self, request: dict[str, Any], job_id: str, model: str, created_at: int) -> None:
        self.request = request
        self.job_id = job_id
        self.model = model
        self.created_at = created_at
        self._sequence = 0
        self._output: list[dict[str, Any]] = []    # finished items
        self._open: dict[str, Any] | None = None   # the item being streamed
        self._open_text: list[str] = []
        self._calls: dict[int, int] = {}           # chat tool call index -> output index
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._had_calls = False

    def start(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress."""
        snapshot = self._response("in_progress", [])
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat.completion.chunk body."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._tool_call(call)
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The open item closed, then response.completed (or .incomplete when cut by length)."""
        events = self._close()
        if not self._had_calls and not any(item["type"] == "message" for item in self._output):
            # An empty answer is still a message, as in the non-streamed body.
            events += self._text("message", "")
            events += self._close()
        status = "incomplete" if self._finish == "length" else "completed"
        response = self._response(status, list(self._output), usage=responses_usage(self._usage))
        events.append(self._event("response.incomplete" if status == "incomplete" else "response.completed",
                                  response=response))
        return events

    def fail(self, message: str, code: str | None) -> list[dict[str, Any]]:
        """response.failed, after the open item closed as incomplete."""
        events = self._close("incomplete")
        error = {"code": "server_error", "message": f"{message} ({code})" if code else message}
        response = self._response("failed", list(self._output), error=error)
        events.append(self._event("response.failed", response=response))
        return events

    # -- items --------------------------------------------------------------------------------

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item = (reasoning_item(self.job_id, "", self.request, "in_progress") if kind == "reasoning"
                    else message_item(self.job_id, "", "in_progress"))
            item["content"] = []
            if kind == "reasoning":
                item["summary"] = []
            events += self._add(item)
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else output_text_part("")
            events.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        if text:
            self._open_text.append(text)
            name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self._event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        index = call.get("index", 0)
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        if index not in self._calls:
            events += self._close()
            self._had_calls = True
            item = function_call_item(call.get("id") or "", function.get("name") or "", "", "in_progress")
            events += self._add(item)
            self._calls[index] = len(self._output)
        if arguments and self._open is not None and self._open["type"] == "function_call" \
                and self._calls[index] == len(self._output):
            self._open_text.append(arguments)
            events.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = item
        self._open_text = []
        return [self._event("response.output_item.added", output_index=len(self._output), item=item)]

    def _close(self, status: str | None = None) -> list[dict[str, Any]]:
        """The open item's .done events; it joins the output."""
        item = self._open
        if item is None:
            return []
        text = "".join(self._open_text)
        where = self._where()
        status = status or ("incomplete" if self._finish == "length" else "completed")
        events = []
        if item["type"] == "function_call":
            done = function_call_item(item["call_id"], item["name"], text, status)
            events.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=text))
        elif item["type"] == "reasoning":
            done = reasoning_item(self.job_id, text, self.request, status)
            part = {"type": "reasoning_text", "text": text}
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
            for index, summary in enumerate(done["summary"]):
                empty = {"type": "summary_text", "text": ""}
                events.append(self._event("response.reasoning_summary_part.added", **where, summary_index=index,
                                          part=empty))
                events.append(self._event("response.reasoning_summary_text.delta", **where, summary_index=index,
                                          delta=summary["text"]))
                events.append(self._event("response.reasoning_summary_text.done", **where, summary_index=index,
                                          text=summary["text"]))
                events.append(self._event("response.reasoning_summary_part.done", **where, summary_index=index,
                                          part=summary))
        else:
            done = message_item(self.job_id, text, status)
            events.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                      logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=output_text_part(text)))
        events.append(self._event("response.output_item.done", output_index=where["output_index"], item=done))
        self._output.append(done)
        self._open = None
        self._open_text = []
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._output)}

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_object(self.request, self.job_id, self.model, output, status=status, usage=usage,
                               created_at=self.created_at, error=error)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event
