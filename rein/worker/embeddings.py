"""The worker's side of an embeddings job (/v1/embeddings): every input through the engine,
the vectors recorded together.

A job with several inputs is one job (one row, one usage, one response), but each input is
its own engine request, so the inputs prefill in the same step loop as everything else and
batch with it. They are queued together (`EngineClient.submit_group`, ids `<job>#<i>`); the
cancel and interrupt paths abort the job id, which aborts the whole group. When every input
is done the vectors go to `results.response` as the response's `data` (floats; the
encoding the request asked for is applied when the body is built), the usage counts the
input tokens, and only then is the job's one (final) event published: an embeddings job
streams no deltas, and the synchronous route finds the result recorded when that event
arrives.

How an attempt ends mirrors rein.worker.tasks: succeeded; cancelled (the inputs done so far
billed); failed past the time limit; refused by the engine (the input's index named);
handed back when interrupted.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from rein.model.pooling_config import PoolingParams
from rein.openai.embeddings import split_inputs, stored_response
from rein.openai.engine_errors import job_error_code
from rein.openai.response import usage_body
from rein.store.messages import JobMessage
from rein.worker.job_end import (
    ABORT_GRACE_SECONDS,
    abort_if_cancelled,
    after_engine_death,
    error_body,
    fail_job,
    hand_back,
    record_result,
)
from rein.worker.recorder import JobRecord

if TYPE_CHECKING:
    from rein.engine.client import CollectingStream
    from rein.engine.step_outputs import RequestOutput
    from rein.jobs.claim import Lease
    from rein.worker.context import WorkerContext

log = logging.getLogger(__name__)


def run_embeddings(context: WorkerContext, message: JobMessage, lease: Lease, cancel_mark: int | None = None) -> str:
    """Run a claimed embeddings job (publisher.begin already called); returns its outcome."""
    # rein.engine.client imports torch: not at a worker module's import (the Celery app, the CLI).
    from rein.engine.client import EngineStoppedError

    job_id = message.job_id
    claimed = time.monotonic()
    try:
        params = PoolingParams(**message.sampling)
        inputs = split_inputs(message.prompt_token_ids,
                              message.input_lengths or [len(message.prompt_token_ids)])
    except (TypeError, ValueError) as exc:
        return fail_job(context, lease, f"invalid embeddings parameters: {exc}", "invalid_request_error",
                        "invalid_pooling_params")
    runner = context.runner
    # Aboard the engine from before the submit: if it dies, this job was present (rein.worker.suspects).
    with context.roster.aboard(runner, lease):
        try:
            streams = runner.submit_group(job_id, inputs, params, message.priority)
        except EngineStoppedError:   # the engine died before the job reached it: not a suspect
            return hand_back(context, message, lease)
        except Exception as exc:  # the engine refused an input (EngineRequestError, ...)
            index = getattr(exc, "index", None)
            where = f"input[{index}]: " if index is not None and len(inputs) > 1 else ""
            return fail_job(context, lease, f"{where}{exc}", "invalid_request_error",
                            job_error_code(exc) or "engine_refused")
        abort_if_cancelled(context, job_id, cancel_mark)
        deadline = time.monotonic() + context.settings.job_timeout_seconds
        try:
            timed_out = not _wait_all(streams, deadline)
            if timed_out:
                context.runner.abort(job_id)
                _wait_all(streams, time.monotonic() + ABORT_GRACE_SECONDS)
        except EngineStoppedError:
            return after_engine_death(context, message, lease, runner)
    finals: list[RequestOutput | None] = [stream.collected.final for stream in streams]
    if any(final is None for final in finals):   # the engine never confirmed the abort
        return fail_job(context, lease, "the job ran past its time limit and the engine did not stop it",
                        "server_error", "timeout")
    done = [final for final in finals if final is not None and final.finish_reason == "stop"]
    aborted = len(done) < len(finals)
    if aborted and not timed_out and context.jobs.is_interrupted(job_id):
        return hand_back(context, message, lease)
    # Billed: the inputs computed to the end (all of them, unless cut short).
    prompt_tokens = sum(final.num_prompt_tokens for final in done)
    cached_tokens = sum(final.num_cached_tokens for final in done)
    usage = usage_body(prompt_tokens, 0, cached_tokens)
    if timed_out:
        record = JobRecord(status="failed", prompt_tokens=prompt_tokens, cached_tokens=cached_tokens, error=error_body(
            f"the job ran past its time limit of {context.settings.job_timeout_seconds} s", "server_error",
            "timeout"))
        final_event = {"error": "the job ran past its time limit and was stopped"}
    elif aborted:
        record = JobRecord(status="cancelled", prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        final_event = {"finish_reason": "abort", "usage": usage}
    else:
        vectors = [final.embedding or [] for final in done]
        record = JobRecord(status="succeeded", finish_reason="stop", response=stored_response(vectors),
                           prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)
        final_event = {"finish_reason": "stop", "usage": usage}
        if context.metrics is not None:
            accepted = claimed - (lease.queue_seconds or 0.0)
            context.metrics.observe_request(accepted=accepted, claimed=claimed, first_token=None,
                                            finished=time.monotonic(), num_output_tokens=0)
    if not record_result(context, lease, record):
        context.publisher.forget(job_id)
        log.warning("job %s attempt %d: lease lost before recording; result dropped", job_id, lease.attempt)
        return "lease lost"
    # After the record: a follower that sees this event finds the result stored.
    context.publisher.publish_final(job_id, **final_event)
    return record.status


def _wait_all(streams: list[CollectingStream], deadline: float) -> bool:
    """Wait for every stream to finish by `deadline`; False if time ran out first."""
    for stream in streams:
        if not stream.wait(max(deadline - time.monotonic(), 0.0)):
            return False
    return True
