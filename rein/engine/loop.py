"""The engine core loop: the one loop that steps an engine, whoever drives it.

Three clients drive an engine, and all of them through `EngineCore.run`:

* the thread runner (rein.engine.client.EngineClient): commands from a queue, outputs to
  per-request streams; for tests, `rein generate` and in-process workers;
* the engine process (rein.engine.process_client): commands from a pipe, outputs back
  through it; what a worker runs;
* the offline driver (rein.offline.driver): requests admitted from an iterable within a
  window, outputs to a callback; `rein run-batch` and `rein.LLM`.

They differ only in where commands come from (`drain`) and where outputs go (`deliver`).
The loop: apply the pending commands (waiting for one when there is nothing to step), step
while any request is unfinished, hand each step's outputs on; when `drain` says stop, abort
what is left and step until it has ended, so every request gets its final output. Under
tensor parallelism this loop runs on rank 0 alone (the scheduler runs once); the other ranks
follow its model runner's step plans (rein.engine.rank_processes). With async scheduling a step
returns the outputs of the step before the one it leaves running (rein.engine.async_scheduling);
the engine has work while one is in flight, so the loop steps on until every output is out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.step_outputs import RequestOutput

# After a stop, the steps allowed for aborted requests to hand out their last outputs (each
# ends at its next step; held grammars and n > 1 groups may take one more).
STOP_STEPS = 3


class EngineCore:
    """See the module docstring.

    `drain(block)` applies pending commands to the engine, waiting for one when `block`
    (nothing to step), and returns False once told to stop. `deliver(outputs)` takes each
    step's outputs. `idle()`, if given, is called when the last requests ended without a
    step (all aborted while waiting), so a client that reports the engine's state can.
    """

    def __init__(self, engine: LLMEngine, drain: Callable[[bool], bool],
                 deliver: Callable[[list[RequestOutput]], None], idle: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.drain = drain
        self.deliver = deliver
        self.idle = idle

    def run(self) -> None:
        """Step until told to stop, then end what is left (see the module docstring).
        An exception from the engine or a callback propagates: the client decides."""
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            if not self.drain(not busy):
                break
            if engine.has_unfinished():
                self.deliver(engine.step())
            elif busy and self.idle is not None:
                self.idle()
        self.finish()

    def finish(self) -> None:
        """Abort every request still in the engine and step until they have ended."""
        engine = self.engine
        for request_id in list(engine.requests):
            engine.abort(request_id)
        for _ in range(STOP_STEPS):
            if not engine.has_unfinished():
                break
            self.deliver(engine.step())
