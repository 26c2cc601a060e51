"""The job task, thin like a web view: unpack the message, claim, hand to the engine, wait,
record. `process_job` is that flow as a plain function (tested without a broker); the
pieces live in claim, publisher, recorder and cancel, and the ways an attempt ends in job_end.

How an attempt ends:

* stop / length — `succeeded`: result, usage and timings in one transaction;
* aborted by a cancel — `cancelled`, with the partial result and the tokens it used;
* past the job time limit — `failed` (code `timeout`), tokens used billed;
* refused by the engine (a prompt it cannot take) — `failed`;
* interrupted (warm shutdown, broker connection lost, Redis or Postgres away, lease lost,
  the engine died) — handed back, the attempt refunded: the job row returns to `queued` and
  a fresh message is queued for it (or, when the lease was lost, nothing: another attempt has
  the job). A job its engine died under comes back a suspect and shares its next engine only
  with jobs that are no suspects and its own suspect group (WorkerContext.gate); one that died
  alone after an earlier death is failed as the cause (`crashes_its_worker`,
  rein.worker.suspects).

While the engine is down (its process died and a new one is starting) a task waits for it
before claiming: nothing is claimed that cannot run, and the worker takes no more messages
than its slots hold meanwhile.

A result that cannot be recorded because Postgres is away is kept, and recorded when
Postgres answers again (rein.worker.job_end.record_result).

The Celery message is acknowledged after this returns in every case (late ack).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from celery import shared_task
from redis.exceptions import RedisError
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError

from rein.core.logging import log_context
from rein.engine.sampling_params import SamplingParams
from rein.jobs.adapters import AdapterRef
from rein.jobs.claim import ClaimOutcome, claim_job
from rein.jobs.image_sources import load_images
from rein.jobs.queues import TASK_NAME
from rein.jobs.results import response_logprobs
from rein.openai.choices_response import response_extra
from rein.openai.endpoints import EMBEDDINGS
from rein.openai.engine_errors import job_error_code
from rein.openai.reasoning import Reasoning, reasoning_token_count
from rein.openai.response import usage_body
from rein.openai.response_shape import ResponseShape, returned_choices
from rein.store.messages import JobMessage
from rein.worker.context import worker_context
from rein.worker.embeddings import run_embeddings
from rein.worker.job_end import (
    ABORT_GRACE_SECONDS,
    abort_if_cancelled,
    after_engine_death,
    error_body,
    fail_job,
    hand_back,
    record_result,
    requeue,
    settle_tpm,
)
from rein.worker.publisher import TIMEOUT
from rein.worker.recorder import JobRecord

if TYPE_CHECKING:
    from rein.engine.client import CollectingStream
    from rein.engine.request_result import RequestResult
    from rein.jobs.claim import Lease
    from rein.worker.context import WorkerContext

log = logging.getLogger(__name__)

# How long a task waits for its worker's engine to come back (a new engine process starting)
# before it sends its message back to the queue, for another worker or a later try.
ENGINE_DOWN_WAIT_SECONDS = 60.0
# A job that could not even be claimed (Postgres or Redis unreachable) is retried this often.
NOT_TAKEN_RETRY_SECONDS = 5


class JobNotTaken(RuntimeError):
    """Postgres or Redis failed before the job was claimed: nothing ran, try again later."""


@shared_task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self: Any, message: dict[str, Any]) -> str:
    """Run one job on this worker's engine; returns how it ended (for logs)."""
    try:
        return process_job(worker_context(self.app), JobMessage.from_dict(message))
    except JobNotTaken as exc:
        with log_context(job_id=message.get("job_id"), key_id=message.get("key_id"),
                         model=message.get("model"), worker=self.request.hostname):
            log.warning("job %s not taken (%s); retrying in %d s", message.get("job_id"), exc.__cause__,
                        NOT_TAKEN_RETRY_SECONDS)
        raise self.retry(exc=exc, countdown=NOT_TAKEN_RETRY_SECONDS, max_retries=None) from exc


def process_job(context: WorkerContext, message: JobMessage) -> str:
    """Claim, run and record one job; returns the outcome ("succeeded", "skipped: finished", ...).

    Every line logged meanwhile carries the job's ids (rein.core.logging), so one grep for
    the job id follows it from the API's "job accepted" to its outcome here.
    """
    with log_context(job_id=message.job_id, key_id=message.key_id, model=message.model,
                     worker=context.worker_name):
        return _process_job(context, message)


def _process_job(context: WorkerContext, message: JobMessage) -> str:
    job_id = message.job_id
    if not context.stopping.is_set() and not context.wait_for_engine(ENGINE_DOWN_WAIT_SECONDS):
        log.warning("job %s not taken: this worker's engine has been down for %.0f s; sent back to the queue",
                    job_id, ENGINE_DOWN_WAIT_SECONDS)
        requeue(context, message)
        return "requeued"
    if context.stopping.is_set():
        requeue(context, message)
        return "requeued"
    # No look at the cancel flag first: the claim refuses a job whose cancel was requested
    # (rein.worker.cancel). The listener's mark, for the check after the submit (abort_if_cancelled).
    cancel_mark = context.listener.mark() if context.listener is not None else None
    try:
        # With the worker's GroupClaimer, jobs whose messages arrive together share one statement.
        claim = (context.claimer.claim(job_id) if context.claimer is not None
                 else claim_job(context.sessions, job_id, context.worker_name, context.settings.lease_seconds))
    except (RedisError, SQLAlchemyError) as exc:
        raise JobNotTaken(str(exc)) from exc
    if claim.lease is None:
        if claim.outcome is ClaimOutcome.CANCELLED:
            context.publisher.publish_final(job_id, finish_reason="abort", usage=usage_body(0, 0))
            settle_tpm(context, job_id, message.key_id, 0)
        elif claim.outcome is ClaimOutcome.GAVE_UP:
            context.publisher.publish_final(job_id, error="the job was started too many times and never finished")
        log.info("job %s not run: %s", job_id, claim.outcome.value)
        return f"skipped: {claim.outcome.value}"
    log.info("job %s started: attempt %d, %d prompt tokens", job_id, claim.lease.attempt,
             len(message.prompt_token_ids))
    with context.jobs.tracking(claim.lease), log_context(attempt=claim.lease.attempt):
        try:
            started = time.monotonic()
            # A suspect of an engine death runs beside no other suspect group (rein.worker.suspects).
            with context.gate.admit(claim.lease.suspect_group, claim.lease.suspect_group_size):
                outcome = _run_claimed(context, message, claim.lease, cancel_mark)
            log.info("job %s attempt %d ended: %s after %.3f s", job_id, claim.lease.attempt, outcome,
                     time.monotonic() - started)
            return outcome
        except (RedisError, OperationalError, InterfaceError) as exc:
            # Redis or Postgres away, not a fault of the job: hand it back to run again (if even
            # that fails, its lease runs out and the reaper queues it).
            log.warning("job %s attempt %d interrupted: %s: %s", job_id, claim.lease.attempt, type(exc).__name__, exc)
            context.interrupt(job_id)
            try:
                return hand_back(context, message, claim.lease)
            except Exception as again:
                log.warning("job %s: not handed back (%s); the reaper queues it when its lease runs out",
                            job_id, again)
                return "lease lost"
        except Exception as exc:
            # Never leave a claimed job running with nobody on it: fail it, or at least hand it back.
            log.exception("job %s attempt %d broke in the worker", job_id, claim.lease.attempt)
            context.runner.abort(job_id)
            try:
                return fail_job(context, claim.lease, f"internal error in the worker: {type(exc).__name__}",
                                "server_error", "worker_error")
            except Exception:
                try:
                    hand_back(context, message, claim.lease)
                except Exception:
                    log.exception("job %s: could not hand it back either; it is retried once its lease "
                                  "expires and its message comes back", job_id)
                raise


def lora_request_of(message: JobMessage) -> Any:
    """The engine's LoRARequest for a job run under a LoRA adapter (its message names it); None."""
    return AdapterRef.from_dict(message.lora).lora_request() if message.lora else None


def count_lora_job(context: WorkerContext, message: JobMessage, status: str, output_tokens: int) -> None:
    """The per-adapter metrics of a job run under a LoRA adapter (nothing for the base model's)."""
    if message.lora and context.metrics is not None:
        context.metrics.observe_lora_job(message.lora["name"], status, len(message.prompt_token_ids), output_tokens)


def _run_claimed(context: WorkerContext, message: JobMessage, lease: Lease, cancel_mark: int | None = None) -> str:
    # Both import torch: not at a worker module's import (the Celery app, the CLI).
    from rein.engine.client import EngineStoppedError
    from rein.engine.structured.decoding import prepare_grammar

    job_id = message.job_id
    claimed = time.monotonic()
    if context.metrics is not None and lease.attempt == 1 and lease.queue_seconds is not None:
        context.metrics.observe_queue_time(lease.queue_seconds)
    # A batch line's deltas go out coalesced (rein.worker.publisher): nobody watches them live.
    context.publisher.begin(job_id, restart=lease.attempt > 1, coalesce=message.batch_id is not None)
    if message.endpoint == EMBEDDINGS:   # every input through the engine, one result (its own module)
        return run_embeddings(context, message, lease, cancel_mark)
    try:
        params = SamplingParams(**message.sampling)
    except (TypeError, ValueError) as exc:
        return fail_job(context, lease, f"invalid sampling parameters: {exc}", "invalid_request_error",
                        "invalid_sampling_params")
    extra: dict[str, Any] = {}
    if message.images:   # a vision model's job: its images from the file store (rein.jobs.image_sources)
        try:
            extra["images"] = load_images(context.file_store(), message.images)
        except (FileNotFoundError, ValueError) as exc:
            return fail_job(context, lease, f"the job's images are no longer in the file store ({exc}); send the "
                            "request again", "server_error", "image_missing")
    prepare_grammar(context.runner, params)   # structured outputs compile here, off the engine thread
    runner = context.runner
    # Aboard the engine from before the submit: if it dies, this job was present (rein.worker.suspects).
    with context.roster.aboard(runner, lease):
        try:
            stream = runner.submit(job_id, message.prompt_token_ids, params, message.priority, collect=True,
                                   lora_request=lora_request_of(message), **extra)
        except EngineStoppedError:   # the engine died before the job reached it: not a suspect
            return hand_back(context, message, lease)
        except Exception as exc:  # the engine refused the request (EngineRequestError, ...), or its adapter
            count_lora_job(context, message, "failed", 0)
            return fail_job(context, lease, str(exc), "invalid_request_error", job_error_code(exc)
                            or "engine_refused")
        abort_if_cancelled(context, job_id, cancel_mark)
        deadline = time.monotonic() + context.settings.job_timeout_seconds
        try:
            timed_out = _wait(context, job_id, stream, deadline)
        except EngineStoppedError:
            return after_engine_death(context, message, lease, runner)
    collected = stream.collected
    final = collected.final
    if final is None:   # the engine never confirmed the abort of a timed-out job
        return fail_job(context, lease, "the job ran past its time limit and the engine did not stop it",
                        "server_error", "timeout")
    if final.error is not None:      # the engine ended it for its own fault (its grammar)
        status, error = "failed", error_body(final.error, "invalid_request_error", "invalid_request")
    elif final.finish_reason == "abort" and not timed_out and context.jobs.is_interrupted(job_id):
        return hand_back(context, message, lease)
    elif timed_out:
        status, error = "failed", error_body(
            f"the job ran past its time limit of {context.settings.job_timeout_seconds} s", "server_error",
            "timeout")
    elif final.finish_reason == "abort":
        status, error = "cancelled", None
    else:
        status, error = "succeeded", None
        if context.metrics is not None:
            # The job was accepted queue_seconds (database clock) before this claim.
            accepted = claimed - (lease.queue_seconds or 0.0)
            context.metrics.observe_request(accepted=accepted, claimed=claimed,
                                            first_token=collected.first_token_monotonic,
                                            finished=time.monotonic(), num_output_tokens=final.num_output_tokens)
    count_lora_job(context, message, status, final.num_output_tokens)
    record = job_record(message, lease.endpoint, collected, params, context.engine.tokenizer, status, error)
    # A batch line was admitted without a TPM charge (rein.batches.manager): nothing to settle.
    if not record_result(context, lease, record, charged=message.batch_id is None):
        log.warning("job %s attempt %d: lease lost before recording; result dropped", job_id, lease.attempt)
        return "lease lost"
    return status


def job_record(message: JobMessage, endpoint: str, collected: RequestResult, params: SamplingParams,
               tokenizer: Any, status: str = "succeeded", error: dict[str, Any] | None = None) -> JobRecord:
    """What a finished attempt records. A plain
    request records its one choice; one with several choices, an echo or prompt logprobs
    also the body parts that shows (rein.openai.choices_response), and usage summed over its choices."""
    final = collected.final
    assert final is not None
    first_token_at = (datetime.fromtimestamp(collected.first_token_at, UTC)
                      if collected.first_token_at is not None else None)
    shape = ResponseShape.from_dict(message.shape)
    gathered = collected
    # Every generated choice's thinking (best_of's too, billed like the rest of their tokens).
    reasoning = Reasoning.from_dict(message.reasoning)
    reasoning_tokens = sum(reasoning_token_count(reasoning, c.token_ids) for c in gathered.ordered()) if reasoning else 0
    if shape.plain and len(gathered.choices) <= 1:
        return JobRecord(
            status=status, error=error, text=collected.text, token_ids=collected.token_ids, finish_reason=final.finish_reason,
            logprobs=response_logprobs(endpoint, collected.logprobs if params.logprobs is not None else None,
                                       tokenizer, message.logprobs_mode),
            prompt_tokens=final.num_prompt_tokens, completion_tokens=final.num_output_tokens,
            cached_tokens=final.num_cached_tokens, reasoning_tokens=reasoning_tokens, first_token_at=first_token_at)
    extra = response_extra(endpoint, gathered, message.prompt_token_ids, tokenizer, message.logprobs_mode, shape)
    first = returned_choices(gathered.ordered(), shape)[0]
    return JobRecord(
        status=status, error=error, text=first.text, token_ids=first.token_ids,
        # An aborted request reads "abort" whatever its first choice had reached.
        finish_reason="abort" if final.finish_reason == "abort" else first.finish_reason or final.finish_reason,
        logprobs=extra["choices"][0]["logprobs"] if extra else None,
        prompt_tokens=final.num_prompt_tokens, completion_tokens=gathered.completion_tokens,
        cached_tokens=final.num_cached_tokens, reasoning_tokens=reasoning_tokens, first_token_at=first_token_at,
        response=extra)


def _wait(context: WorkerContext, job_id: str, stream: CollectingStream, deadline: float) -> bool:
    """Wait for the job's end, aborting it at the deadline; True when it ran out of time."""
    if stream.wait(max(deadline - time.monotonic(), 0.0)):
        return False
    context.publisher.mark_abort(job_id, TIMEOUT)
    context.runner.abort(job_id)
    stream.wait(ABORT_GRACE_SECONDS)   # collected.final stays None if it is never confirmed
    return True


