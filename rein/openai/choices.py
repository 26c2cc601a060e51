"""The choices of one request: n > 1, best_of, echo and prompt logprobs, everywhere they pass.

The engine hands back each step's delta of one choice (`RequestOutput.index`; see
rein.engine.outputs). Every consumer that wants whole answers — the worker's collecting
stream, the offline driver, the API's fallback when the stored result is late — gathers
them here, per choice, in a `ChoiceGatherer`. `ResponseShape` says what the answer looks
like beyond the sampling params: how many choices are returned (best_of generates more and
keeps the likeliest), whether a completion echoes its prompt, and whether vLLM's
`prompt_logprobs` field is wanted. It travels with a job (JobMessage.shape) so the worker
builds the same body the offline runner does (rein.openai.choice_bodies).

No web framework and no torch here: the API, the worker and the offline runner import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rein.engine.outputs import RequestOutput, TokenLogprob


@dataclass
class ResponseShape:
    """How the engine's choices become the response (beyond SamplingParams).

    `n`: choices returned; SamplingParams.n is what the engine generates (more with
    best_of, of which the `n` with the highest cumulative logprob are kept). `echo`: the
    completions prompt's text, put before each choice's text (None: no echo); with
    logprobs the choice's logprobs cover the prompt tokens first, as OpenAI's legacy
    completions. `prompt_logprobs`: vLLM's `prompt_logprobs` (k alternatives per prompt
    token) asked for in the response; None: not.
    """

    n: int = 1
    echo: str | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None

    @property
    def plain(self) -> bool:
        """True when the body is the plain one-choice answer (nothing more to build or store)."""
        return (self.n == 1 and self.echo is None and self.prompt_logprobs is None
                and (self.best_of or 1) == 1)

    def to_dict(self) -> dict[str, Any] | None:
        """Only what differs from the plain answer (None for it): what a queue message carries."""
        if self.plain:
            return None
        data: dict[str, Any] = {"n": self.n}
        if self.echo is not None:
            data["echo"] = self.echo
        if self.prompt_logprobs is not None:
            data["prompt_logprobs"] = self.prompt_logprobs
        if self.best_of is not None and self.best_of != self.n:
            data["best_of"] = self.best_of
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ResponseShape:
        if not data:
            return cls()
        return cls(n=int(data.get("n", 1)), echo=data.get("echo"), prompt_logprobs=data.get("prompt_logprobs"),
                   best_of=data.get("best_of"))


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


class ChoiceGatherer:
    """A request's outputs gathered per choice index.

    `add` takes every output of the request in order; `finished` becomes True with the
    output that ends the whole request (RequestOutput.finished). With n == 1 there is one
    choice, index 0, and this is what the plain path always gathered.
    """

    def __init__(self) -> None:
        self.choices: dict[int, Choice] = {}
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.final: RequestOutput | None = None
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0

    def choice(self, index: int) -> Choice:
        found = self.choices.get(index)
        if found is None:
            found = self.choices[index] = Choice(index)
        return found

    def add(self, output: RequestOutput) -> None:
        choice = self.choice(output.index)
        if output.new_token_ids:
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


def returned_choices(choices: list[Choice], shape: ResponseShape) -> list[Choice]:
    """The choices the response returns, renumbered 0..n-1: all of them, or with best_of the
    `shape.n` with the highest cumulative logprob (best first, as vLLM's best_of did)."""
    if len(choices) <= shape.n:
        return choices
    ranked = sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:shape.n]
    return [Choice(i, c.text_parts, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            for i, c in enumerate(ranked)]
