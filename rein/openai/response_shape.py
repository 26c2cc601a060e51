"""The choices of one request as the response returns them: n > 1, best_of, echo and prompt
logprobs.

The engine's outputs are gathered per choice in a rein.engine.request_result.RequestResult.
`ResponseShape` says what the answer looks
like beyond the sampling params: how many choices are returned (best_of generates more and
keeps the likeliest), whether a completion echoes its prompt, and whether vLLM's
`prompt_logprobs` field is wanted. It travels with a job (JobMessage.shape) so the worker
builds the same body the offline runner does (rein.openai.choices_response).

No web framework and no torch here: the API, the worker and the offline runner import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rein.engine.request_result import Choice


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


def returned_choices(choices: list[Choice], shape: ResponseShape) -> list[Choice]:
    """The choices the response returns, renumbered 0..n-1: all of them, or with best_of the
    `shape.n` with the highest cumulative logprob (best first, as vLLM's best_of did)."""
    if len(choices) <= shape.n:
        return choices
    ranked = sorted(choices, key=lambda c: (-c.cumulative_logprob, c.index))[:shape.n]
    return [Choice(i, c.text_parts, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)
            for i, c in enumerate(ranked)]
