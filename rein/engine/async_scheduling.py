"""Async scheduling (EngineConfig.async_scheduling, vLLM's name): the host's work of a step
overlaps the model's forward pass.

A synchronous step is schedule -> forward -> sample -> detokenize, stops, update -> outputs,
each stage waiting for the one before. Here the forward and the sampling of step N run on a
worker thread (torch's ops and rein's ctypes kernels release the GIL), and meanwhile the
engine's thread

* plans step N+1 (`Scheduler.schedule_ahead`): every running request decodes one more token,
  at the position step N ends it on, whose input is the token N samples; requests that N's
  token ends by length are left out, those it ends by a stop are planned and their rows
  dropped when N+1 completes (it computed them for nothing);
* once N's tokens are there: appends them to the requests, lays out step N+1 (the runner's
  `prepare`) and starts it on the worker;
* then, while N+1 runs, finishes step N: detokenizes, checks stops (stop strings included:
  their row in N+1 is dropped like an end-of-sequence one), updates the scheduler and makes
  N's outputs, which `step` returns.

So a `step` call returns the outputs of the step before the one it leaves running, and the
first call of a run returns none. Every output is the same as without it: the sampler of step
N+1 sees the requests' outputs with N's token, as it would have, and the rows computed in
vain are never read. What is planned ahead is only what `schedule` would have planned after
N's update (see `Scheduler.schedule_ahead`, which refuses the rest); otherwise N completes
first and the next step is scheduled as usual, launched on the worker when it is one this
pipeline runs: not when a request of it has a grammar (its mask needs the token before), is
an n > 1 request that forks this step, runs a LoRA adapter, has images, or is an embedding
request; those steps run synchronously. Tensor parallelism keeps every step synchronous (the
engine does not build this pipeline under it).

The worker only runs the model runner's `run` (the device half of a step) and the sampler;
everything that touches requests, the scheduler or the KV blocks stays on the engine's thread,
and the runner's `prepare` is called only while the worker is idle. A request aborted while
its row is in flight is dropped the same way. The blocks the dropped rows write to were either
freed (written again only by a later forward, which runs after this one) or are the partly
filled last block of a finished request, which the prefix cache never holds.

Where step N sampled inside its decode graph (rein.engine.cuda_graphs) and step N+1, planned
ahead, samples inside its own, N+1 does not wait for N's ids to reach the host: its requests get
a placeholder token (PENDING_TOKEN), the runner's `prepare` lays it out, and its graph takes
those rows' input ids from N's sampled ids on the device (`ModelRunner.feed`); the engine's
thread launches N+1 and only then reads N's ids, for N's outputs (stops, detokenizing) and in
place of the placeholders. Otherwise N's ids are read first and written into N+1's plan. The
CPU runs the same logic, with the graphs run eagerly (`DecodeGraphs(capture=False)`) or, without
graphs, with the ids read and written into the plan.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rein.engine.scheduler_output import ModelOutput, SchedulerOutput

if TYPE_CHECKING:
    from rein.engine.engine import LLMEngine
    from rein.engine.model_runner import PreparedStep, StepResult
    from rein.engine.sampler import SamplerOutput  # noqa: F401 (annotations)
    from rein.engine.step_outputs import RequestOutput


# A request's last output token while it is only on the device (`_launch_ahead`): a valid id,
# never read as a token (the decode graph feeds the real one, or it is replaced first).
PENDING_TOKEN = 0


@dataclass
class _InFlight:
    """A step running on the worker: its plan, its result to come (the runner's result, the
    sampler's output or None, the seconds they took) and when it was launched."""

    plan: SchedulerOutput
    future: Future
    started: float


class AsyncScheduling:
    """The engine's step in the async order (see the module docstring). `LLMEngine.step` calls
    `step`; `busy` says a step is still in flight (the engine has work while it is)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        device = engine.runner.device
        # One worker: the steps' forwards run one after another, in launch order.
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rein-forward",
            initializer=(lambda: torch.cuda.set_device(device)) if device.type == "cuda" else None)
        self._inflight: _InFlight | None = None

    @property
    def busy(self) -> bool:
        return self._inflight is not None

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def step(self) -> list[RequestOutput]:
        engine = self.engine
        outputs = engine._between_steps()
        completed = self._inflight is not None
        if completed:
            outputs.extend(self._complete())
            if self._inflight is not None or not engine._has_work():
                return outputs
            # As a synchronous engine's next step would begin.
            outputs.extend(engine._between_steps())
        started = time.perf_counter()
        plan = engine._schedule()
        if plan.is_empty:
            return outputs
        if self._overlaps(plan):
            self._launch(plan, engine.runner.prepare(plan.scheduled), started)
        else:
            outputs.extend(engine._run_step(plan, started))
        return outputs

    @staticmethod
    def _overlaps(plan: SchedulerOutput) -> bool:
        """Whether the step of `plan` may run on the worker: none of its requests needs the
        engine's thread between the logits and the sampler (a grammar's mask, a fork) or is one
        this pipeline leaves synchronous (LoRA, images, embeddings)."""
        for s in plan.scheduled:
            request = s.request
            if request.grammar is not None or request.lora_request is not None or request.images is not None \
                    or request.pooling is not None:
                return False
            if s.samples and request.group is not None and not request.group.forked:
                return False
        return True

    def _launch(self, plan: SchedulerOutput, prepared: PreparedStep, started: float) -> None:
        self._inflight = _InFlight(plan, self._worker.submit(self._run, prepared), started)

    def _run(self, prepared: PreparedStep) -> tuple[StepResult, SamplerOutput | None, float]:
        """On the worker: the step's forward and its sampling, or None where its decode graph
        samples (the ids are read on the engine's thread, when it needs them)."""
        started = time.perf_counter()
        engine = self.engine
        result = engine.runner.run(prepared)
        sampled = None
        if result.sampling and result.sampled is None:
            with torch.inference_mode():
                sampled = engine.sample(result)
        return result, sampled, time.perf_counter() - started

    def _launch_ahead(self, ahead: SchedulerOutput, result: StepResult, sampled: SamplerOutput | None
                      ) -> SamplerOutput:
        """Start the step planned ahead of the one that came back (`result`, and `sampled`, None
        while its ids are in its decode graph's output only) with its requests' tokens, the next
        step's inputs, appended. Ids still on the device are appended as PENDING_TOKEN first; the
        next step goes before they are read where its decode graph takes them from the device
        (`ModelRunner.feed`), otherwise once they are, written into its plan. Returns the
        sampled step's tokens."""
        engine = self.engine
        started = time.perf_counter()
        rows = [row for row, request in enumerate(result.sampling) if not request.status.finished]
        if sampled is not None:
            _append_tokens(result, rows, sampled.token_ids)
            self._launch(ahead, engine.runner.prepare(ahead.scheduled), started)
            return sampled
        _append_tokens(result, rows, None)
        prepared = engine.runner.prepare(ahead.scheduled)
        pending = engine.runner.feed(prepared, result)
        if prepared.fed is not None:
            self._launch(ahead, prepared, started)
        sampled = engine.sample(result)
        for row in rows:
            result.sampling[row].output_token_ids[-1] = sampled.token_ids[row]
        if prepared.fed is None:
            input_ids = prepared.plan.input_ids
            for row, source in pending:
                input_ids[row] = sampled.token_ids[source]
            self._launch(ahead, prepared, started)
        return sampled

    def _complete(self) -> list[RequestOutput]:
        """Wait for the step in flight; start the next one when it can be planned ahead (with
        the tokens appended first), then finish the step that came back: its outputs."""
        engine = self.engine
        inflight, self._inflight = self._inflight, None
        ahead = None
        if not engine.grammars.has_held:   # a compiled grammar lets its request in at the next schedule
            ahead = engine.scheduler.schedule_ahead(inflight.plan)
        result, sampled, forward_seconds = inflight.future.result()
        if ahead is not None:
            sampled = self._launch_ahead(ahead, result, sampled)
            engine.stats.planned_ahead += 1
        elif sampled is None and result.sampling:
            sampled = engine.sample(result)
        _drop_ended(inflight.plan, result, sampled)
        output = ModelOutput(prompt_logprobs=result.prompt_logprobs)
        deltas: list[str] = []
        if sampled is not None:
            output.sampled, output.token_ids = result.sampling, sampled.token_ids
            deltas = engine._read_tokens(output)
        return engine._finish_step(inflight.plan, result, output, sampled, deltas, inflight.started,
                                   forward_seconds, appended=ahead is not None)


def _append_tokens(result: StepResult, rows: list[int], token_ids: list[int] | None) -> None:
    """Each of `rows`' requests gets its token (None: PENDING_TOKEN, replaced once known)."""
    sampling = result.sampling
    if token_ids is None:
        for row in rows:
            sampling[row].output_token_ids.append(PENDING_TOKEN)
    else:
        for row in rows:
            sampling[row].output_token_ids.append(token_ids[row])


def _drop_ended(plan: SchedulerOutput, result: StepResult, sampled: SamplerOutput | None) -> None:
    """Take the rows of requests that ended while the step was in flight (by the token of the
    step before, or aborted) out of its plan and results: nothing of them is kept."""
    if all(not s.request.status.finished for s in plan.scheduled):
        return
    plan.scheduled = [s for s in plan.scheduled if not s.request.status.finished]
    if result.prompt_logprobs is not None:
        result.prompt_logprobs = [entry for entry in result.prompt_logprobs if not entry[0].status.finished]
    rows = [row for row, request in enumerate(result.sampling) if not request.status.finished]
    if len(rows) == len(result.sampling):
        return
    result.sampling = [result.sampling[row] for row in rows]
    if sampled is not None:
        sampled.token_ids = [sampled.token_ids[row] for row in rows]
        if sampled.logprobs is not None:
            sampled.logprobs = [sampled.logprobs[row] for row in rows]
        if sampled.top_logprobs is not None:
            sampled.top_logprobs = [sampled.top_logprobs[row] for row in rows]
