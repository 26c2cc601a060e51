"""What the engine hands back each step, per request: the new tokens and text delta, and
on the last one the finish reason. Deltas concatenate to the final text exactly."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: str | None = None          # stop | length | abort
    stop_reason: str | int | None = None      # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0                # prompt tokens taken from the prefix cache
    index: int = 0                            # the choice (0..n-1) of a request with n > 1
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which
    # has no context), on the request's first output only.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding request's pooled vector (its only, finished, output).
    embedding: list[float] | None = None
    # Why the engine ended the request itself, for the request's own fault (its grammar did
    # not compile, or not in time): finish_reason is then "abort", and the job fails with this.
    error: str | None = None
