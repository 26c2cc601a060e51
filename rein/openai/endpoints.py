"""The OpenAI endpoints rein serves, by path."""

from __future__ import annotations

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS)
EMBEDDINGS = "/v1/embeddings"   # its requests and responses: rein.openai.embeddings
# The urls a batch line (and POST /v1/jobs) may name.
BATCH_ENDPOINTS = (*ENDPOINTS, EMBEDDINGS)
