"""The engine's front door and step loop: add_request / abort / step.

Each step: the scheduler picks requests and token counts, the model runner runs one
forward pass, the sampler picks the next token of every request that finished its
prompt, the detokenizer turns it into a text delta, and stop conditions end requests
(their blocks go back to the pool at once). The engine knows nothing of queues,
databases or Celery; a caller drives `step()` (directly, or through `EngineRunner`).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from rein.engine.block_pool import BlockPool
from rein.engine.config import EngineConfig
from rein.engine.detokenizer import IncrementalDetokenizer
from rein.engine.errors import ContextLengthExceeded, EngineRequestError
from rein.engine.model_runner import ModelRunner
from rein.engine.outputs import RequestOutput, TokenLogprob
from rein.engine.request import Request, RequestStatus
from rein.engine.sampler import Sampler, SamplingBatch, make_generator
from rein.engine.sampling_params import SamplingParams
from rein.engine.scheduler import Scheduler
from rein.model_files import resolve_model
from rein.structured.decoding import StructuredDecoding

log = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Running totals, for benchmarks, logs and (later) metrics."""

    steps: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    prompt_tokens: int = 0          # prompt tokens computed (recomputes included)
    generation_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    scheduled_requests: int = 0     # summed over steps (a step's batch size)
    scheduled_tokens: int = 0       # summed over steps (prefill chunks + decodes)
    peak_kv_utilization: float = 0.0   # max over steps of tokens stored / slots allocated
    peak_kv_usage: float = 0.0         # max share of blocks in use
    prefix_cache_queries: int = 0      # prompt tokens of requests admitted (first time, caching on)
    prefix_cache_hits: int = 0         # of those, tokens found in the prefix cache

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, sampling, text)."""
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.files = resolve_model(config.model)
        self.model_dir = self.files.directory
        self.spec = self.files.spec
        self.tokenizer = self.files.load_tokenizer()
        self.runner = ModelRunner(config, self.files, self.spec)
        self.max_model_len = self.runner.max_model_len
        self.pool = BlockPool(self.runner.capacity.num_blocks, config.block_size,
                              enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(self.spec.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        # Structured outputs (rein.structured): compiled grammars, requests held until theirs is.
        self.grammars = StructuredDecoding(self.tokenizer, self.spec.vocab_size, self.eos_token_ids,
                                           self.runner.device)
        self.stats = EngineStats()
        self._seeds = random.Random(config.seed)
        self._aborted: list[Request] = []

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int] | str, params: SamplingParams | None = None,
                    priority: int = 0) -> Request:
        """Queue a request; raises EngineRequestError (e.g. ContextLengthExceeded) if it cannot run."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise EngineRequestError(f"request id {request_id!r} is already in the engine", param="request_id")
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) \
            else list(prompt)
        if not token_ids:
            raise EngineRequestError("the prompt is empty: give at least one token", param="prompt")
        vocab = self.spec.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineRequestError(f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                                     param="prompt")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(self.max_model_len, len(token_ids), params.max_tokens)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            priority=priority,
        )
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, token_ids, skip_special_tokens=params.skip_special_tokens, stop=params.stop)
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            request.generator = make_generator(seed, self.runner.device)
        ready = params.structured is None or self.grammars.attach(request)   # raises on a bad spec
        self.requests[request_id] = request
        if ready:
            self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> bool:
        """End a request now; its blocks are freed and its last output says `abort`."""
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return False
        if self.grammars.unhold(request):
            request.status = RequestStatus.FINISHED_ABORTED
        else:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        self._aborted.append(request)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._aborted) or self.grammars.has_held

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        outputs = [self._final_output(r) for r in self._aborted]
        for request in self._aborted:
            self.requests.pop(request.request_id, None)
        self._aborted = []
        if self.grammars.has_held:
            outputs.extend(self._release_compiled())

        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        self.stats.prefix_cache_queries += plan.prefix_cache_queries
        self.stats.prefix_cache_hits += plan.prefix_cache_hits
        if plan.is_empty:
            return outputs
        forward_start = time.perf_counter()
        result = self.runner.execute(plan.scheduled)
        forward_seconds = time.perf_counter() - forward_start

        self.stats.scheduled_requests += len(plan.scheduled)
        caching, block_size = self.pool.enable_caching, self.pool.block_size
        for s in plan.scheduled:
            request = s.request
            self.stats.scheduled_tokens += s.end - s.start
            request.num_computed_tokens = s.end
            self.stats.prompt_tokens += max(0, min(s.end, request.num_prompt_tokens) - s.start)
            if caching and s.end // block_size > request.num_registered_blocks:
                self.scheduler.register_computed_blocks(request)
        self._record_kv_utilization()
        if result.sampling:
            outputs.extend(self._sample_and_update(result.logits, result.sampling))

        elapsed = time.perf_counter() - started
        self.stats.steps += 1
        self.stats.step_seconds += elapsed
        self.stats.forward_seconds += forward_seconds
        return outputs

    def _sample_and_update(self, logits: torch.Tensor, sampling: list[Request]) -> list[RequestOutput]:
        # The hot loop of the step on CPU (one pass per sampled request), kept lean on purpose.
        batch = SamplingBatch(
            params=[r.sampling_params for r in sampling],
            generators=[r.generator for r in sampling],
            prompt_token_ids=[r.prompt_token_ids for r in sampling],
            output_token_ids=[r.output_token_ids for r in sampling],
        )
        self.grammars.apply_masks(logits, sampling)
        sampled = self.sampler(logits, batch)
        now = time.monotonic()
        outputs = []
        append = outputs.append
        logprobs, top_logprobs = sampled.logprobs, sampled.top_logprobs
        for row, (request, token) in enumerate(zip(sampling, sampled.token_ids, strict=True)):
            output_ids = request.output_token_ids
            output_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            logprob = None
            if logprobs is not None and request.sampling_params.logprobs is not None:
                logprob = [TokenLogprob(token, logprobs[row], top_logprobs[row] if top_logprobs else [])]
            detokenizer = request.detokenizer
            delta = detokenizer.add_token(token)
            status = self._stop_status(request, token, len(output_ids))
            if request.grammar is not None and request.grammar.accept(token):
                status = RequestStatus.FINISHED_STOPPED   # the grammar is complete: nothing may follow
            if status is not None:
                if not detokenizer.stopped:
                    delta += detokenizer.finish()  # release text held back for a stop string
                self.scheduler.finish(request, status)
                self.requests.pop(request.request_id, None)
                self.stats.finished += 1
            append(RequestOutput(
                request.request_id, [token], delta, status is not None, request.finish_reason,
                request.stop_reason, len(request.prompt_token_ids), len(output_ids), logprob,
                request.num_cached_tokens,
            ))
        self.stats.generation_tokens += len(sampling)
        return outputs

    def _stop_status(self, request: Request, token: int, num_output: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.detokenizer.stopped:
            request.stop_reason = request.detokenizer.stop_string
            return RequestStatus.FINISHED_STOPPED
        if token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens or num_output + len(request.prompt_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _release_compiled(self) -> list[RequestOutput]:
        """Schedule the held requests whose grammar compiled; end those whose compile failed."""
        ready, failed = self.grammars.release(idle=not self.scheduler.has_unfinished())
        for request in ready:
            self.scheduler.add(request)
        for request, _reason in failed:
            request.status = RequestStatus.FINISHED_ABORTED
            self.requests.pop(request.request_id, None)
        return [self._final_output(request) for request, _reason in failed]

    def _final_output(self, request: Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[], text_delta="", finished=True,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens)

    def _record_kv_utilization(self) -> None:
        # Tokens whose K/V sit in the cache after this step's forward, against the slots the
        # running requests' blocks provide: only the last, partly filled block is wasted.
        running = self.scheduler.running
        if not running:
            return
        slots = sum(len(r.block_ids) for r in running) * self.pool.block_size
        tokens = sum(r.num_computed_tokens for r in running)
        if slots:
            self.stats.peak_kv_utilization = max(self.stats.peak_kv_utilization, tokens / slots)
        self.stats.peak_kv_usage = max(self.stats.peak_kv_usage, self.pool.usage)
