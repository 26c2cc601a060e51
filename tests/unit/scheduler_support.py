"""Helpers of the scheduler-alone tests (no model): requests with distinct prompts and a
driver that runs the scheduler as the engine does (imported by name, as unit_support)."""

from __future__ import annotations

from rein.core.priorities import PRIORITY_BATCH, PRIORITY_INTERACTIVE
from rein.engine.request import ChoiceGroup, Request
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.engine.scheduler_output import ModelOutput

INTERACTIVE, BATCH = PRIORITY_INTERACTIVE, PRIORITY_BATCH


def request(rid: str, prompt_len: int = 8, max_tokens: int = 20, priority: int = BATCH, n: int = 1,
            first_token: int = 1) -> Request:
    # Distinct prompts (by first_token) so that the prefix cache never mixes requests up.
    prompt = [first_token * 1000 + i for i in range(prompt_len)]
    r = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, n=n), priority=priority)
    if n > 1:
        r.group = ChoiceGroup(n)
        r.group.choices.append(r)
    return r


class Driver:
    """Runs the scheduler as the engine does (schedule, then update with the step's tokens),
    with a fake model: each sampled token is a function of the request and position, so a
    recomputed request samples nothing new; requests end on max_tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.finished: dict[str, int] = {}   # '<request id>/<choice index>' -> step it finished in
        self.plans = []

    def step(self):
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        sampled = [s.request for s in plan.scheduled if s.samples]
        tokens = [50_000 + r.num_output_tokens for r in sampled]
        self.scheduler.update(plan, ModelOutput(sampled=sampled, token_ids=tokens))
        for r in sampled:
            if r.is_finished:
                self.finished[f"{r.request_id}/{r.index}"] = self.scheduler.num_steps
        return plan

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
