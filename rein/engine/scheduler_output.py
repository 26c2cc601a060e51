"""The records of one step, between the scheduler and the rest of the engine: the plan
(`SchedulerOutput`, a `ScheduledRequest` per request: which positions it computes), what the
step computed (`ModelOutput`, built by the engine from the model runner's result and the
sampler's tokens) and what `Scheduler.update` reports back (`StepUpdate`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rein.engine.request import Request


class ScheduledRequest:
    """One request's share of a step: positions [start, end) are computed. `samples` is true
    when the step reaches the request's last token, so it yields a new one. Plain slots, as
    the model runner reads these fields for every request of every step."""

    __slots__ = ("request", "start", "num_new_tokens", "end", "samples")

    def __init__(self, request: Request, start: int, num_new_tokens: int, samples: bool | None = None) -> None:
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        self.end = end = start + num_new_tokens
        # `samples` given: the scheduler knows it already (it read the request's num_tokens).
        self.samples = end == len(request.prompt_token_ids) + len(request.output_token_ids) \
            if samples is None else samples


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefix_cache_queries: int = 0   # prompt tokens of the requests admitted for the first time
    prefix_cache_hits: int = 0      # of those, tokens taken from the prefix cache
    priority_preemptions: int = 0   # of `preempted`, those preempted for a better-ranked waiting request

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens this step computes (recomputes included)."""
        # Decodes (start past the prompt) are skipped by the filter, before any arithmetic.
        return sum(min(s.end, n) - s.start for s in self.scheduled
                   if s.start < (n := len(s.request.prompt_token_ids)))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelOutput:
    """What one step computed, as `Scheduler.update` applies it: the engine builds it from the
    model runner's result and the sampler's tokens. Row i: `sampled[i]` drew `token_ids[i]`."""

    sampled: list[Request] = field(default_factory=list)   # in logits-row order, forked choices included
    token_ids: list[int] = field(default_factory=list)
    # n > 1 requests whose prompt this step finished, each with its new choices (in `sampled` too).
    forks: list[tuple[Request, list[Request]]] = field(default_factory=list)
    stop_strings: dict[int, str] = field(default_factory=dict)   # rows whose text matched a stop string
    complete: set[int] = field(default_factory=set)   # rows whose structured output is complete
    # Prompt logprobs (request, first prompt index scored, entries), None when no request asked.
    prompt_logprobs: list[tuple[Request, int, list]] | None = None
    pooled: list[Request] = field(default_factory=list)   # embedding requests whose prompt is done


@dataclass
class StepUpdate:
    """What `Scheduler.update` tells the engine for its outputs and stats."""

    ended: set[int] = field(default_factory=set)   # rows of ModelOutput.sampled whose output ends the request
    # After the forward, before forks and stops (None without running requests): tokens
    # stored / slots the running requests' blocks provide, and the share of blocks in use.
    kv_utilization: float | None = None
    kv_usage: float | None = None
