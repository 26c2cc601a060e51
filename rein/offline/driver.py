"""The offline engine loop shared by `rein run-batch` and `rein.LLM`.

`drive` takes work items one at a time from any iterable, but only while fewer than
`max_in_flight` requests are in the engine, so memory stays bounded however long the
input is. It steps the engine in the calling thread, gathers each request's tokens, text
and logprobs, and hands every finished request back once. The caller decides what an
item is, how it becomes an engine request (`admit`), and what to do with the result
(`finish`); the loop itself is the same for both front ends.

If anything raises (a callback, the engine, Ctrl-C), the requests still in flight are
aborted before the exception propagates, so a reused engine is not left running them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from rein.openai.choices import ChoiceGatherer

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.outputs import RequestOutput, TokenLogprob

Item = TypeVar("Item")
State = TypeVar("State")

IN_FLIGHT_PER_SEQ = 4   # default window: this many requests per engine batch slot


def default_max_in_flight(engine: LLMEngine) -> int:
    """Enough read-ahead that the scheduler always has a full batch to pick from."""
    return IN_FLIGHT_PER_SEQ * engine.config.max_num_seqs


@dataclass
class FinishedRequest(Generic[State]):
    """One request's whole answer, as its step outputs added up.

    `choices` holds every choice of an n > 1 request (rein.openai.choices), and the prompt
    logprobs; `text`, `token_ids` and `logprobs` are choice 0's, the whole answer of a
    plain request. `finish_reason` is the request's (the last choice to end)."""

    request_id: str
    state: State                                  # what `admit` returned with the request id
    choices: ChoiceGatherer = field(default_factory=ChoiceGatherer)
    finish_reason: str | None = None              # stop | length | abort
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    embedding: list[float] | None = None          # an embedding request's vector

    @property
    def text(self) -> str:
        return self.choices.choice(0).text

    @property
    def token_ids(self) -> list[int]:
        return self.choices.choice(0).token_ids

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.choices.choice(0).logprobs

    def add(self, output: RequestOutput) -> None:
        self.choices.add(output)
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.num_cached_tokens = output.num_cached_tokens
            self.num_prompt_tokens = output.num_prompt_tokens
            self.embedding = output.embedding


def drive(
    engine: LLMEngine,
    items: Iterable[Item],
    admit: Callable[[Item], tuple[str, State] | list[tuple[str, State]] | None],
    finish: Callable[[FinishedRequest[State]], None],
    max_in_flight: int,
) -> None:
    """Run every item through the engine, at most `max_in_flight` requests at a time.

    admit(item) adds the item's request to the engine and returns (request_id, state), or
    returns None when the item needs no engine work (e.g. it was answered with an error),
    or a list of (request_id, state) when it made several requests (an embeddings line's inputs).
    finish(result) is called once per admitted request, when it ends (its finish_reason
    may be "abort"). Outputs of requests this call did not admit are ignored.
    """
    limit = max(1, max_in_flight)
    in_flight: dict[str, FinishedRequest[State]] = {}
    source = iter(items)
    exhausted = False
    try:
        while True:
            while not exhausted and len(in_flight) < limit:
                item = next(source, _END)
                if item is _END:
                    exhausted = True
                    break
                admitted = admit(item)
                for request_id, state in [admitted] if isinstance(admitted, tuple) else admitted or ():
                    in_flight[request_id] = FinishedRequest(request_id, state)
            if not in_flight:
                if exhausted:
                    return
                continue
            if not engine.has_unfinished():
                raise RuntimeError(f"the engine has no unfinished requests but {len(in_flight)} are "
                                   f"waiting for an answer (engine bug)")
            for output in engine.step():
                result = in_flight.get(output.request_id)
                if result is None:
                    continue
                result.add(output)
                if output.finished:
                    del in_flight[output.request_id]
                    finish(result)
    except BaseException:
        for request_id in in_flight:
            engine.abort(request_id)
        raise


_END = object()
