"""One generation request inside the engine: its tokens, progress, state and blocks.

Status is data: an enum where every state past RUNNING is a finished one, each mapped to
an OpenAI finish reason (`stop | length | abort`).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from rein.engine.block_pool import ROOT
from rein.engine.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    """A request's whole state. `num_computed_tokens` catches up to `num_tokens`:
    that one rule covers prefill (in chunks), decode and recompute after preemption."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix caching (rein.engine.block_pool): prompt tokens found cached at the first
    # admission (for usage), how many leading full blocks are registered, and the link the
    # next one is registered under.
    num_cached_tokens: int = 0
    num_registered_blocks: int = 0
    cache_parent: tuple[int, int] = ROOT
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Engine-owned helpers (detokenizer, generator, structured-output matcher); opaque to the scheduler.
    detokenizer: Any = None
    generator: Any = None
    grammar: Any = None
    # Stop strings cut the text; set when one matched.
    stop_reason: str | int | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_at(self, index: int) -> int:
        if index < len(self.prompt_token_ids):
            return self.prompt_token_ids[index]
        return self.output_token_ids[index - len(self.prompt_token_ids)]

    def tokens(self, start: int, end: int) -> list[int]:
        """All tokens in [start, end): prompt first, then output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def sort_key(self) -> tuple[int, int]:
        """Waiting-queue order: lower priority value first, then first come first served."""
        return (self.priority, self.arrival_order)
