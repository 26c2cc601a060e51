"""Field types and caps that the API's schemas and the batch schemas share."""

from __future__ import annotations

from typing import Literal

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]


MAX_METADATA_PAIRS = 16
