"""The engine core loop (rein.engine.loop): what every client of the engine runs."""

from __future__ import annotations

from unit_support import make_engine, prompt_of

from rein.engine.loop import EngineCore
from rein.engine.sampling_params import SamplingParams


def test_commands_join_between_steps_and_a_stop_ends_what_is_left(model_dir):
    """Requests added while others run join at the next step; when drain says stop, the
    running request is aborted and still gets its final output; waiting only when idle."""
    engine = make_engine(model_dir)
    outputs, blocks, steps = [], [], []
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    short = SamplingParams(max_tokens=2, ignore_eos=True)

    def drain(block: bool) -> bool:
        blocks.append(block)
        if not steps:
            engine.add_request("long", prompt_of(8, 1), long)
        elif len(steps) == 2:
            engine.add_request("short", prompt_of(8, 2), short)   # joins the running batch
        return len(steps) < 6

    def deliver(step_outputs):
        steps.append(step_outputs)
        outputs.extend(step_outputs)

    EngineCore(engine, drain, deliver).run()
    finals = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finals == {"short": "length", "long": "abort"}
    assert blocks[0] is True and not any(blocks[1:])   # it waited only while the engine was empty
    assert not engine.has_unfinished() and not engine.requests

