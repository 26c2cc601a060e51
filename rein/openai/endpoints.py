"""The OpenAI endpoints rein serves, by path."""

from __future__ import annotations

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS)
EMBEDDINGS = "/v1/embeddings"   # its requests and responses: rein.openai.embeddings
# OpenAI's Responses API: runs as a chat request (rein.openai.responses), answers as a `response`.
RESPONSES = "/v1/responses"
# The urls a batch line (and POST /v1/jobs) may name.
BATCH_ENDPOINTS = (*ENDPOINTS, EMBEDDINGS, RESPONSES)


def generated_as(endpoint: str) -> str:
    """The endpoint whose body a job's output is first built as: /v1/responses runs as chat."""
    return CHAT_COMPLETIONS if endpoint == RESPONSES else endpoint
