"""One generation request inside the engine: its tokens, progress, state and blocks.

Status is data: an enum where every state past RUNNING is a finished one, each mapped to
an OpenAI finish reason (`stop | length | abort`).

A request with SamplingParams.n > 1 starts as ONE Request (choice 0) that carries a
`ChoiceGroup`; when its prompt is computed it forks into n choices (the engine makes them,
`LLMEngine._fork`; the scheduler starts them, `Scheduler.fork`), each a Request of its own
from then on (own output, blocks, generator), sharing the prompt's full KV blocks through
the pool's reference counts.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rein.engine.block_pool import ROOT, prefix_root
from rein.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rein.model.lora.request import LoRARequest

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
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS[self]


# Read for every request of every step: a plain int to compare with and a list indexed by
# status are cheaper than enum members and a dict keyed by them.
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS: list[str | None] = [None] * (max(RequestStatus) + 1)
_FINISH_REASONS[RequestStatus.FINISHED_STOPPED] = "stop"
_FINISH_REASONS[RequestStatus.FINISHED_LENGTH] = "length"
_FINISH_REASONS[RequestStatus.FINISHED_ABORTED] = "abort"


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
    # The scheduler's step when it first queued the request (-1: not yet): its age for the
    # priority aging rule (rein.engine.scheduler), kept through preemptions.
    arrival_step: int = -1
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
    # Windowed layers' storage (rein.engine.window_blocks): block_ids[window_first:window_end]
    # are the blocks this request holds there (those its next query's window still covers).
    window_first: int = 0
    window_end: int = 0
    num_preemptions: int = 0
    first_token_time: float | None = None
    # Engine-owned helpers (detokenizer, generator, structured-output matcher); opaque to the scheduler.
    detokenizer: Any = None
    generator: Any = None
    grammar: Any = None
    # Stop strings cut the text; set when one matched.
    stop_reason: str | int | None = None
    # n > 1: the choice this is (0..n-1) and the group of all the request's choices.
    index: int = 0
    group: ChoiceGroup | None = None
    # SamplingParams.prompt_logprobs: entries gathered chunk by chunk (entry i scores prompt
    # token i; entry 0 is None), None when not asked for or once handed out.
    prompt_logprobs: list | None = None
    # An embedding request's pooling state (rein.engine.pooler.PoolingState); None: it generates.
    pooling: Any = None
    # Not looked up in the prefix cache (mean/CLS pooling needs every prompt position computed).
    skip_prefix_cache: bool = False
    # LoRA (rein.model.lora): the adapter the request runs under (None: the base model) and its
    # loaded weights (engine-owned, opaque to the scheduler; held here, so an adapter stays loaded
    # while a request needs it). Its prefix-cache chains start from the adapter's own root.
    lora_request: LoRARequest | None = None
    lora_weights: Any = None
    # Images (rein.engine.multimodal.RequestImages): their prompt spans, encoder inputs, the
    # prefix-cache key tokens and M-RoPE positions; None for a text-only request. Shared by choices.
    images: Any = None

    def __post_init__(self) -> None:
        if self.lora_request is not None:
            self.cache_parent = self.cache_root

    @property
    def lora_int_id(self) -> int:
        """The request's adapter id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def cache_root(self) -> tuple[int, int]:
        """The predecessor of the request's first block in the prefix cache (its adapter's root)."""
        return prefix_root(self.lora_int_id)

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

    def key_tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) as the prefix cache keys them: an image's positions hold a value
        derived from the image (rein.engine.multimodal), every other position its token."""
        if self.images is None:
            return self.tokens(start, end)
        keys, n = self.images.key_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return list(keys[start:end])
        if start >= n:
            return self.tokens(start, end)
        return list(keys[start:n]) + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS[self.status]

    def check_stop(self, token: int, stop_string: str | None, max_model_len: int | None) -> RequestStatus | None:
        """The finished status the just appended output `token` gives the request, or None: a
        stop string its text matched (`stop_string`), an end-of-sequence or stop token, or
        max_tokens / max_model_len reached. Sets `stop_reason` for a stop string or stop token."""
        if stop_string is not None:
            self.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        params = self.sampling_params
        if params.stop_token_ids and token in params.stop_token_ids:
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        num_output = len(self.output_token_ids)
        if num_output >= params.max_tokens or (
                max_model_len is not None and num_output + len(self.prompt_token_ids) >= max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    @property
    def num_unforked_choices(self) -> int:
        """Choices this request will still fork into (n - 1 until its prompt is done, else 0):
        the scheduler keeps sequence slots for them."""
        group = self.group
        return group.n - 1 if group is not None and not group.forked else 0


class ChoiceGroup:
    """The choices of one request with n > 1. `choices` holds choice 0 until the fork, then
    all n; `num_unfinished` counts down as choices end, and the output of the choice that
    takes it to 0 is the request's finished one."""

    __slots__ = ("n", "choices", "forked", "num_unfinished")

    def __init__(self, n: int) -> None:
        self.n = n
        self.choices: list[Request] = []
        self.forked = False
        self.num_unfinished = n
