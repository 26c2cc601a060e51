"""The vision encoder's outputs, kept by image (its SHA-256 and detail), least recently used
dropped first once they pass `max_tokens` rows.

An image's embeddings [tokens, hidden] are computed once (rein.engine.model_runner runs the
encoder) and read from here by every chunk of its prompt, by the choices of an n > 1 request, by
a request preempted and recomputing, and by any later request with the same image. The scheduler
asks it which images are cached (`__contains__`) to keep each step's encoder work within its
budget; the runner puts and gets the tensors. An entry larger than the whole cache is kept until
the next put (a step still needs it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"the encoder cache needs room for at least one token, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, Any] = OrderedDict()
        self._tokens = 0
        self.encoded_images = 0   # images the encoder ran on (cache misses), for stats and tests
        self.hits = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def get(self, key: str) -> Any:
        """The embeddings of `key` (most recently used from now on), or None."""
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return value

    def put(self, key: str, value: Any) -> None:
        """Keep `value` [tokens, hidden] under `key`, dropping the least recently used entries
        that no longer fit."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= old.shape[0]
        self._entries[key] = value
        self._tokens += value.shape[0]
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, dropped = self._entries.popitem(last=False)
            self._tokens -= dropped.shape[0]

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0
