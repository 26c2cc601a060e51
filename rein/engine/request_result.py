"""A request's whole answer, gathered from its step outputs: the one accumulator of every
consumer that wants whole answers (the worker's collecting stream, the offline driver, the
API's fallback when the stored result is late).

The engine hands back each step's delta of one choice (`RequestOutput.index`; see
rein.engine.step_outputs). `RequestResult.add` takes every output of a request in order and
keeps them per choice (n > 1, best_of), with the prompt logprobs, the final output and when
the first token came. With n == 1 there is one choice, index 0, and `text`, `token_ids` and
`logprobs` are the whole answer. No torch here: the API imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rein.engine.step_outputs import RequestOutput, TokenLogprob


@dataclass
class Choice:
    """One choice's whole answer, its step outputs added up."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None          # set once this choice ended
    stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class RequestResult:
    """A request's outputs gathered per choice index (see the module docstring).

    `finished` becomes True with the output that ends the whole request
    (RequestOutput.finished), which `final` then holds. `request_id` and `state` are the
    caller's: what it needs to know the result by (the offline driver's admit callback).
    """

    def __init__(self, request_id: str = "", state: Any = None) -> None:
        self.request_id = request_id
        self.state = state
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.final: RequestOutput | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.first_token_at: float | None = None          # time.time() when the first token came
        self.first_token_monotonic: float | None = None   # the same moment on time.monotonic()

    def choice(self, index: int) -> Choice:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = Choice(index)
        return found

    def add(self, output: RequestOutput) -> None:
        choice = self.choice(output.index)
        if output.new_token_ids:
            if self.first_token_at is None:
                self.first_token_at = time.time()
                self.first_token_monotonic = time.monotonic()
            choice.token_ids.extend(output.new_token_ids)
        if output.text_delta:
            choice.text_parts.append(output.text_delta)
        if output.logprobs:
            choice.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finish_reason is not None:
            choice.finish_reason = output.finish_reason
            choice.stop_reason = output.stop_reason
        if output.num_prompt_tokens:
            self.num_prompt_tokens = output.num_prompt_tokens
            self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.final = output
            # An aborted request ends every choice, also those the engine had no output for.
            for other in self.choices.values():
                if other.finish_reason is None:
                    other.finish_reason = output.finish_reason

    @property
    def finished(self) -> bool:
        return self.final is not None

    def ordered(self) -> list[Choice]:
        """Every choice, by index (one per index the engine produced, at least choice 0)."""
        if not self.choices:
            self.choice(0)
        return [self.choices[i] for i in sorted(self.choices)]

    @property
    def completion_tokens(self) -> int:
        """Tokens generated over all choices (OpenAI's usage sums them; the prompt counts once)."""
        return sum(len(c.token_ids) for c in self.choices.values())

    # -- choice 0 and the final output: the whole answer of a plain request ----------------

    @property
    def text(self) -> str:
        return self.choice(0).text

    @property
    def token_ids(self) -> list[int]:
        return self.choice(0).token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choice(0).logprobs

    @property
    def finish_reason(self) -> str | None:
        """The request's (the last choice to end): stop | length | abort."""
        return self.final.finish_reason if self.final is not None else None

    @property
    def stop_reason(self) -> str | int | None:
        return self.final.stop_reason if self.final is not None else None

    @property
    def embedding(self) -> list[float] | None:
        """An embedding request's vector."""
        return self.final.embedding if self.final is not None else None
