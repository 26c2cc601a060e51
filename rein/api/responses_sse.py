"""The SSE of a streamed POST /v1/responses: the job's chat chunks (rein.api.streams.openai_chunk_stream,
with the chat body the request runs as) turned into Responses events
(rein.openai.responses_stream.ResponsesStream). No `[DONE]`: the Responses stream ends with
its response.completed (or .incomplete / .failed) event, as OpenAI's does."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from rein.api.streams import KEEPALIVE, StreamEvent, openai_chunk_stream
from rein.openai.endpoints import CHAT_COMPLETIONS
from rein.openai.reasoning import Reasoning
from rein.openai.responses import chat_body
from rein.openai.responses_stream import ResponsesStream, sse_event

_DATA = "data: "


async def responses_event_stream(events: AsyncIterator[StreamEvent | None], *, job_id: str, model: str,
                                 prompt_tokens: int, request_body: dict[str, Any],
                                 tool_parser: str | None = None,
                                 reasoning: Reasoning | None = None) -> AsyncIterator[str]:
    """Responses' SSE events for a job's token events."""
    stream = ResponsesStream(request_body, job_id, model, int(time.time()))
    for event in stream.start():
        yield sse_event(event)
    chunks = openai_chunk_stream(events, endpoint=CHAT_COMPLETIONS, job_id=job_id, model=model,
                                 prompt_tokens=prompt_tokens, include_usage=True, request_body=chat_body(request_body),
                                 tool_parser=tool_parser, reasoning=reasoning)
    async with aclosing(chunks):
        async for line in chunks:
            if line == KEEPALIVE:
                yield line
                continue
            data = line.removeprefix(_DATA).rstrip("\n")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]
                for event in stream.fail(error.get("message") or "the job failed", error.get("code")):
                    yield sse_event(event)
                return
            for event in stream.feed(chunk):
                yield sse_event(event)
    for event in stream.finish():
        yield sse_event(event)
