"""The offline client of the engine core loop, shared by `rein run-batch` and `rein.LLM`.

`drive` takes work items one at a time from any iterable, but only while fewer than
`max_in_flight` requests are in the engine, so memory stays bounded however long the
input is. It runs the engine core loop (rein.engine.loop) in the calling thread, gathers
each request's outputs (a rein.engine.request_result.RequestResult, whose `state` is what `admit`
returned with its id), and hands every finished request back once. The caller decides what
an item is, how it becomes an engine request (`admit`), and what to do with the result
(`finish`); the loop itself is the same for both front ends.

If anything raises (a callback, the engine, Ctrl-C), the requests still in flight are
aborted before the exception propagates, so a reused engine is not left running them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from rein.engine.loop import EngineCore
from rein.engine.request_result import RequestResult

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.step_outputs import RequestOutput

Item = TypeVar("Item")
State = TypeVar("State")

IN_FLIGHT_PER_SEQ = 4   # default window: this many requests per engine batch slot


def default_max_in_flight(engine: LLMEngine) -> int:
    """Enough read-ahead that the scheduler always has a full batch to pick from."""
    return IN_FLIGHT_PER_SEQ * engine.config.max_num_seqs


def drive(
    engine: LLMEngine,
    items: Iterable[Item],
    admit: Callable[[Item], tuple[str, State] | list[tuple[str, State]] | None],
    finish: Callable[[RequestResult], None],
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
    in_flight: dict[str, RequestResult] = {}
    source = iter(items)
    exhausted = False

    def drain(block: bool) -> bool:
        """Admit items while the window has room (never waits: the items are at hand); False
        once every item is admitted and every request has ended."""
        nonlocal exhausted
        while not exhausted and len(in_flight) < limit:
            item = next(source, _END)
            if item is _END:
                exhausted = True
                break
            admitted = admit(item)
            for request_id, state in [admitted] if isinstance(admitted, tuple) else admitted or ():
                in_flight[request_id] = RequestResult(request_id, state)
        if not in_flight:
            return not exhausted
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine has no unfinished requests but {len(in_flight)} are "
                               f"waiting for an answer (engine bug)")
        return True

    def deliver(outputs: list[RequestOutput]) -> None:
        for output in outputs:
            result = in_flight.get(output.request_id)
            if result is None:
                continue
            result.add(output)
            if output.finished:
                del in_flight[output.request_id]
                finish(result)

    try:
        EngineCore(engine, drain, deliver).run()
    except BaseException:
        for request_id in in_flight:
            engine.abort(request_id)
        raise


_END = object()
