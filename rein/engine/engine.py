"""The engine's front door and step loop: add_request / abort / step.

Each step is schedule -> execute -> update -> outputs: the scheduler picks requests and
token counts, the model runner runs one forward pass, the sampler picks the next token of
every request that finished its prompt and the detokenizer turns it into a text delta, the
scheduler applies all of it to the requests (`Scheduler.update`: computed tokens, blocks,
stops; a finished request's blocks go back at once), and the engine makes the outputs. The
engine never touches blocks (the scheduler's KV cache manager owns them) and knows nothing of
queues, databases or Celery; a caller drives `step()` (directly, or through `EngineClient`).

A request with n > 1 choices is prefilled once, as choice 0; in the step that computes
its last prompt token it forks (`_fork`): choices 1..n-1 become requests of their own
that share the prompt's KV blocks (`Scheduler.fork`, from `update`), and all n draw their
first token from the same logits row, each with its own generator (seed + index). Every
output names its choice (`index`); `finish_reason` ends that choice and `finished` only the
last one to end. `self.requests` maps a request id to its choice 0, whose `group` lists all
choices.

LoRA (EngineConfig.enable_lora): a request may name an adapter (`lora_request`). `add_request`
loads it (from the runner's host cache, rein.engine.lora_slots) and the request holds the
weights; a bad adapter, or an adapter on an engine without enable_lora, is that request's error
(EngineRequestError, param "lora_request"), never the engine's. The scheduler keeps a step's
adapters within max_loras; the runner puts them in the model's slots.

Async scheduling (EngineConfig.async_scheduling): `step` hands over to
rein.engine.async_scheduling.AsyncScheduling, which runs the same stages in another order (the
forward and sampling of one step on a worker thread while this thread finishes the step before
and plans the next) with the helpers below, so both orders make the same outputs.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from rein.core.images import ImageInput
from rein.core.settings import setting_or_default
from rein.engine.async_scheduling import AsyncScheduling
from rein.engine.block_pool import BlockPool
from rein.engine.config import EngineConfig
from rein.engine.detokenizer import IncrementalDetokenizer
from rein.engine.encoder_cache import EncoderCache
from rein.engine.errors import ContextLengthExceeded, EngineRequestError
from rein.engine.kv_cache_manager import KVCacheManager
from rein.engine.model_runner import ModelRunner, StepResult
from rein.engine.multimodal import RequestImages, prepare_images
from rein.engine.pooler import add_pooling_request, pooled_outputs
from rein.engine.rank_processes import RankProcesses, rank_device
from rein.engine.request import ChoiceGroup, Request, RequestStatus
from rein.engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from rein.engine.sampling_params import SamplingParams, fits_context
from rein.engine.scheduler import Scheduler
from rein.engine.scheduler_output import ModelOutput, SchedulerOutput, StepUpdate
from rein.engine.step_outputs import RequestOutput, TokenLogprob
from rein.engine.structured.decoding import StructuredDecoding
from rein.engine.window_blocks import WindowBlocks
from rein.model.files import resolve_model
from rein.model.implementation import TRANSFORMERS_FAMILY, check_shardable, spec_for
from rein.model.lora.request import LoRARequest
from rein.model.parallel.layers import attention_heads
from rein.model.pooling_config import PoolingParams, read_pooling_config
from rein.model.tokenizer_files import TokenizerOptions
from rein.model.vision.processor import load_vision_processor

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
    encoder_seconds: float = 0.0       # vision models: time in the vision encoder (inside forward_seconds)
    encoded_images: int = 0            # images the encoder ran on (the encoder cache's misses)
    planned_ahead: int = 0             # async scheduling: steps planned while the step before ran

    @property
    def overhead_share(self) -> float:
        """Share of step time spent outside the model forward (scheduling, sampling, text). Under
        async scheduling a step's time runs from its launch to its outputs, overlapping the next."""
        return 1.0 - self.forward_seconds / self.step_seconds if self.step_seconds else 0.0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.files = resolve_model(config.model, revision=config.revision)
        self.model_dir = self.files.directory
        self.spec = spec_for(self.files.directory, config.model_impl, config.trust_remote_code)
        if self.spec.family == TRANSFORMERS_FAMILY and not config.enforce_eager:
            # A model's transformers code is not known to be safe to capture in a CUDA graph
            # (a host sync inside it fails the capture), so it runs every step eagerly.
            self.config = config = dataclasses.replace(config, enforce_eager=True)
        self.ranks: RankProcesses | None = None
        if config.tensor_parallel_size > 1:
            if self.spec.vision_config is not None:
                raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size}: vision models run on one "
                                 f"rank only for now; use tensor_parallel_size 1")
            self.config = config = self._check_tensor_parallel(config)
        # --tokenizer, --chat-template and --trust-remote-code as the API applies them.
        self.tokenizer = self.files.load_tokenizer(TokenizerOptions.of(config))
        # A vision model's processor (None: the model takes text only), and the most pixels an
        # image may declare (REIN_MAX_IMAGE_PIXELS; the API checked it first).
        self.vision_processor = load_vision_processor(self.model_dir, self.tokenizer)
        self.max_image_pixels = config.max_image_pixels
        if config.tensor_parallel_size > 1:
            # Ranks 1..N-1 start loading their shards while this one loads shard 0.
            self.ranks = RankProcesses.start(config)
            try:
                self.runner = ModelRunner(config, self.files, self.spec, self.ranks.group, self.ranks)
                self.ranks.wait_ready()
            except BaseException as exc:
                error = self.ranks.error_of(exc)
                self.ranks.close()
                if error is exc:
                    raise
                raise error from exc
        else:
            self.runner = ModelRunner(config, self.files, self.spec)
        self.pooling_config = read_pooling_config(self.model_dir)   # for embedding requests
        self.max_model_len = self.runner.max_model_len
        capacity = self.runner.capacity
        kv_cache = KVCacheManager.create(capacity.num_blocks, config.block_size, config.enable_prefix_caching,
                                         capacity.num_windowed_blocks, capacity.window)
        self.runner.attach(kv_cache)
        # The vision encoder's outputs by image (rein.engine.encoder_cache); None for a text model.
        self.encoder_cache = EncoderCache(config.encoder_cache_tokens) if self.vision_processor is not None else None
        self.runner.encoder_cache = self.encoder_cache
        self.scheduler = Scheduler(kv_cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   interactive_step_budget=config.interactive_step_budget,
                                   max_model_len=self.max_model_len,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   encoder_cache=self.encoder_cache,
                                   max_num_encoder_tokens=config.max_num_encoder_tokens,
                                   image_tokens_whole_chunk=bool(
                                       getattr(self.runner.model, "image_tokens_whole_chunk", False)))
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        self.eos_token_ids = frozenset(self.spec.eos_token_ids) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        # Structured outputs (rein.engine.structured): compiled grammars, requests held until theirs is.
        self.grammars = StructuredDecoding(self.tokenizer, self.spec.vocab_size, self.eos_token_ids,
                                           self.runner.device)
        self.stats = EngineStats()
        self._seeds = random.Random(config.seed)
        self._aborted: list[RequestOutput] = []
        self._num_unforked = 0   # n > 1 requests not forked yet (the step checks for forks)
        # Async scheduling's pipeline (None: every step synchronous). Not under tensor parallelism:
        # the other ranks follow rank 0's plans in lockstep, which this pipeline has not been
        # checked against.
        self._pipeline: AsyncScheduling | None = None
        if config.async_scheduling:
            if self.ranks is not None:
                log.info("async scheduling is off under tensor parallelism: every step runs synchronously")
            else:
                self._pipeline = AsyncScheduling(self)

    def _check_tensor_parallel(self, config: EngineConfig) -> EngineConfig:
        """Refuse, before any rank starts, a model tensor parallelism cannot shard (ValueError
        naming the sizes that would do). Decode steps replay CUDA graphs on every rank in
        lockstep (rein.engine.rank_processes) only with REIN_CUDA_GRAPHS_TENSOR_PARALLEL=1;
        otherwise they run eagerly."""
        size = config.tensor_parallel_size
        check_shardable(self.spec, size)
        attention_heads(self.spec, size)
        # Rank 0's device with its index: NCCL binds each rank to one (rank r takes index + r).
        config = dataclasses.replace(config, device=rank_device(config.device, 0))
        # Graphs capture the NCCL collectives, which no multi-GPU run has checked yet: opt in.
        if not setting_or_default("cuda_graphs_tensor_parallel"):
            config = dataclasses.replace(config, enforce_eager=True)
        return config

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks and async scheduling's worker thread."""
        if self._pipeline is not None:
            self._pipeline.close()
        if self.ranks is not None:
            self.ranks.close()

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: list[int] | str,
                    params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, images: list[ImageInput] | None = None) -> Request:
        """Queue a request; raises EngineRequestError (e.g. ContextLengthExceeded) if it cannot run.
        PoolingParams make it an embedding request (rein.engine.pooler). `lora_request`: the
        LoRA adapter it runs under (None: the base model); loaded now, its errors are the request's.
        `images`: the prompt's images, in order (rein.core.images.ImageInput); the prompt token ids
        are already expanded (rein.model.vision.processor.VisionProcessor.expand), each image a run
        of the model's image token (rein.engine.multimodal). Image tokens are prompt tokens: they
        count in the context length and in usage."""
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
        if isinstance(params, PoolingParams):
            if images:
                raise EngineRequestError("embedding requests take text only, not images", param="input")
            if lora_request is not None:
                raise EngineRequestError("LoRA adapters run generation requests only, not embeddings",
                                         param="lora_request")
            return add_pooling_request(self, request_id, token_ids, params, priority)
        if not self.runner.model.can_generate:
            raise EngineRequestError("this model's checkpoint has no lm_head weights: it computes embeddings "
                                     "only (/v1/embeddings)", param="model")
        if not fits_context(len(token_ids), params.max_tokens, self.max_model_len):
            raise ContextLengthExceeded(self.max_model_len, len(token_ids), params.max_tokens)
        if params.logit_bias:
            bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
            if bad is not None:
                raise EngineRequestError(
                    f"logit_bias names token id {bad}, outside the vocabulary (0..{vocab - 1}): "
                    f"use token ids of this model's tokenizer", param="logit_bias")
        request_images = None
        if images:
            if isinstance(prompt, str):
                raise EngineRequestError("a request with images needs its prompt as token ids, expanded by the "
                                         "model's processor (VisionProcessor.expand)", param="prompt")
            request_images = prepare_images(token_ids, list(images), self.runner.model, self.vision_processor,
                                            self.max_image_pixels)
            self._check_image_chunks(request_images)
        elif self.vision_processor is not None and getattr(self.runner.model, "image_token_id", None) in token_ids:
            raise EngineRequestError(
                f"the prompt holds image tokens (id {self.runner.model.image_token_id}) but the request has no "
                f"images: give one image per image placeholder", param="messages")
        lora_weights = self._load_adapter(lora_request) if lora_request is not None else None
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            priority=priority,
            lora_request=lora_request,
            lora_weights=lora_weights,
            images=request_images,
        )
        ready = params.structured is None or self.grammars.attach(request)   # raises on a bad spec
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]   # the first prompt token has no context
        if params.n > 1:
            request.group = ChoiceGroup(params.n)
            request.group.choices.append(request)
            self._num_unforked += 1
        self._init_choice_state(request)
        self.requests[request_id] = request
        if ready:
            self.scheduler.add(request)
        return request

    def _check_image_chunks(self, images: RequestImages) -> None:
        """A model whose image tokens must be computed in one chunk (image_tokens_whole_chunk)
        cannot take an image longer than a step's token budget."""
        if not self.runner.model.image_tokens_whole_chunk:
            return
        longest = max(item.length for item in images.items)
        if longest > self.config.max_num_batched_tokens:
            raise EngineRequestError(
                f"an image of the request takes {longest} tokens, more than a step computes "
                f"(max_num_batched_tokens {self.config.max_num_batched_tokens}), and this model needs each "
                f"image's tokens in one step: send a smaller image or raise max_num_batched_tokens",
                param="messages")

    def _load_adapter(self, lora_request: LoRARequest) -> Any:
        """The adapter's weights (the runner's host cache, else read now); EngineRequestError when
        this engine serves no adapters or this one cannot be loaded."""
        if not isinstance(lora_request, LoRARequest):
            raise EngineRequestError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}",
                                     param="lora_request")
        slots = self.runner.lora
        if slots is None:
            raise EngineRequestError(
                f"the request asks for LoRA adapter {lora_request.lora_name!r}, but this engine was started "
                f"without LoRA: start it with enable_lora=True (and max_loras, max_lora_rank to fit the "
                f"adapters)", param="lora_request")
        try:
            return slots.load(lora_request)
        except (ValueError, OSError) as exc:   # AdapterError is a ValueError: what is wrong and what to do
            raise EngineRequestError(str(exc), param="lora_request") from exc

    def lora_event(self, event: str, lora_request: LoRARequest) -> None:
        """An adapter registered ("load": read it into the host cache now, before its first request)
        or unloaded ("unload": drop it from the host cache; requests holding it keep it). Never
        raises: a bad adapter is reported to its requests when they come."""
        if self.runner.lora is None:
            return
        if event == "unload":
            self.runner.lora.forget(lora_request.lora_int_id)
            return
        try:
            self._load_adapter(lora_request)
        except EngineRequestError as exc:
            log.warning("LoRA adapter %s announced but not loaded: %s", lora_request.lora_name, exc)

    def _init_choice_state(self, choice: Request) -> None:
        """Create the per-choice helpers of a new request or of a forked choice: its
        detokenizer (stop strings) and, when it samples, its generator, seeded `seed +
        index` (a fresh seed per choice when the request has none), so each choice's tokens
        depend on neither the batch nor the other choices. (A forked choice's grammar
        matcher is a copy of its parent's: see `_fork`.)"""
        params = choice.sampling_params
        choice.detokenizer = IncrementalDetokenizer(
            self.tokenizer, choice.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop, min_tokens=params.min_tokens)
        if not params.greedy:
            seed = params.seed + choice.index if params.seed is not None else self._seeds.getrandbits(63)
            choice.generator = make_generator(seed, self.runner.device)

    def abort(self, request_id: str) -> bool:
        """End a request now (all its choices); their blocks are freed and the last output
        of each unfinished choice says `abort` (the last of them is the finished one)."""
        request = self.requests.get(request_id)
        if request is None or (request.is_finished and request.group is None):
            return False
        if request.group is not None and request.group.num_unfinished == 0:
            return False   # aborted already; its outputs are still to come
        self._aborted.extend(self._end_request(request))
        return True

    def has_unfinished(self) -> bool:
        return self._has_work() or (self._pipeline is not None and self._pipeline.busy)

    def _has_work(self) -> bool:
        """Whether a step has anything to do besides finishing the one in flight (async scheduling)."""
        return self.scheduler.has_unfinished() or bool(self._aborted) or self.grammars.has_held

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def pool(self) -> BlockPool:
        """The KV block pool, to read (usage, free blocks: metrics, `rein top`, tests)."""
        return self.scheduler.kv_cache.pool

    @property
    def windows(self) -> WindowBlocks | None:
        """The windowed layers' block map, to read; None when they have no storage of their own."""
        return self.scheduler.kv_cache.windows

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    # -- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self._pipeline is not None:
            return self._pipeline.step()
        started = time.perf_counter()
        outputs = self._between_steps()
        plan = self._schedule()
        if not plan.is_empty:
            outputs.extend(self._run_step(plan, started))
        return outputs

    def _schedule(self) -> SchedulerOutput:
        plan = self.scheduler.schedule()
        self.stats.preemptions += len(plan.preempted)
        self.stats.prefix_cache_queries += plan.prefix_cache_queries
        self.stats.prefix_cache_hits += plan.prefix_cache_hits
        return plan

    def _run_step(self, plan: SchedulerOutput, started: float) -> list[RequestOutput]:
        """The step of `plan`, synchronously: forward, sampling, update, outputs."""
        forward_start = time.perf_counter()
        result = self.runner.execute(plan.scheduled)
        forward_seconds = time.perf_counter() - forward_start
        output, sampled, deltas = self._sample(result)
        return self._finish_step(plan, result, output, sampled, deltas, started, forward_seconds)

    def _finish_step(self, plan: SchedulerOutput, result: StepResult, output: ModelOutput,
                     sampled: SamplerOutput | None, deltas: list[str], started: float, forward_seconds: float,
                     appended: bool = False) -> list[RequestOutput]:
        """The scheduler's update of a sampled step and its outputs (`appended`: the sampled
        tokens are in the requests' outputs already, async scheduling's `Scheduler.update`)."""
        update = self.scheduler.update(plan, output, appended)
        outputs = self._token_outputs(output, sampled, deltas, update)
        outputs.extend(self._pooled_outputs(result))
        self._record(plan, update, len(output.sampled), time.perf_counter() - started, forward_seconds)
        return outputs

    def _between_steps(self) -> list[RequestOutput]:
        """The outputs of requests ended between steps: aborted ones, and those whose grammar
        failed to compile (the ones whose grammar compiled are scheduled from now on)."""
        outputs: list[RequestOutput] = []
        if self._aborted:
            outputs, self._aborted = self._aborted, []
            for out in outputs:
                if out.finished:
                    self.requests.pop(out.request_id, None)
        if self.grammars.has_held:
            outputs.extend(self._release_compiled())
        return outputs

    def _sample(self, result: StepResult) -> tuple[ModelOutput, SamplerOutput | None, list[str]]:
        """Fork the n > 1 requests that finished their prompt, sample every sampling row, and
        run each token through its choice's detokenizer and grammar: what the scheduler's update
        needs (with the step's prompt logprobs and pooled requests), the sampler's output (for
        logprobs) and each row's text delta."""
        output = ModelOutput(prompt_logprobs=result.prompt_logprobs, pooled=[r for r, _ in result.pooled])
        if not result.sampling:
            return output, None, []
        # The hot loop of the step on CPU (one pass per sampled request), kept lean on purpose.
        logits, sampling = result.logits, result.sampling
        if result.sampled is not None:   # sampled inside the decode graph: no fork, no grammar
            sampled = self.sample(result)
        else:
            if self._num_unforked:
                logits, sampling = self._fork(logits, sampling, output.forks)
            self.grammars.apply_masks(logits, sampling)
            sampled = self.sampler(logits, SamplingBatch.of(sampling))
        output.sampled, output.token_ids = sampling, sampled.token_ids
        return output, sampled, self._read_tokens(output)

    def sample(self, result: StepResult) -> SamplerOutput:
        """The step's tokens, as the decode graph sampled them (waiting for their copy to the host)
        or sampled now from its logits, for a step with no forks or grammar masks."""
        if result.sampled is not None:
            return SamplerOutput(result.sampled.tolist(), None, None)
        return self.sampler(result.logits, SamplingBatch.of(result.sampling))

    @staticmethod
    def _read_tokens(output: ModelOutput) -> list[str]:
        """Run each sampled token through its choice's detokenizer (stop strings) and grammar,
        noting in `output` the rows they end; returns each row's text delta."""
        deltas = []
        append = deltas.append
        for row, (request, token) in enumerate(zip(output.sampled, output.token_ids, strict=True)):
            detokenizer = request.detokenizer
            # The end-of-sequence token that ends a request is not part of its text, as in vLLM
            # (it would show where special tokens are kept: skip_special_tokens false).
            append(detokenizer.add_token(token) if token not in request.eos_token_ids else "")
            if detokenizer.stopped:
                output.stop_strings[row] = detokenizer.stop_string
            if request.grammar is not None and request.grammar.accept(token):
                output.complete.add(row)
        return deltas

    def _token_outputs(self, output: ModelOutput, sampled: SamplerOutput | None, deltas: list[str],
                       update: StepUpdate) -> list[RequestOutput]:
        """One output per sampled row, after the scheduler's update (which ended some choices)."""
        if sampled is None:
            return []
        outputs = []
        append = outputs.append
        ended = update.ended
        logprobs, top_logprobs = sampled.logprobs, sampled.top_logprobs
        for row, (request, token, delta) in enumerate(zip(output.sampled, output.token_ids, deltas, strict=True)):
            logprob = None
            if logprobs is not None and request.sampling_params.logprobs is not None:
                logprob = [TokenLogprob(token, logprobs[row], top_logprobs[row] if top_logprobs else [])]
            if request.is_finished and not request.detokenizer.stopped:
                delta += request.detokenizer.finish()  # release text held back for a stop string
            finished = row in ended
            if finished:
                self.requests.pop(request.request_id, None)
                self.stats.finished += 1
            out = RequestOutput(
                request.request_id, [token], delta, finished, request.finish_reason,
                request.stop_reason, len(request.prompt_token_ids), len(request.output_token_ids), logprob,
                request.num_cached_tokens, request.index,
            )
            if request.prompt_logprobs is not None:   # all gathered: they go with the first token
                out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            append(out)
        return outputs

    def _pooled_outputs(self, result: StepResult) -> list[RequestOutput]:
        """The outputs of the embedding requests the update ended (their prompt is done)."""
        if not result.pooled:
            return []
        for request, _ in result.pooled:
            self.requests.pop(request.request_id, None)
        self.stats.finished += len(result.pooled)
        return pooled_outputs(result.pooled)

    def _record(self, plan: SchedulerOutput, update: StepUpdate, num_sampled: int, seconds: float,
                forward_seconds: float) -> None:
        stats = self.stats
        stats.scheduled_requests += len(plan.scheduled)
        stats.scheduled_tokens += plan.num_batched_tokens
        stats.prompt_tokens += plan.num_prompt_tokens
        stats.generation_tokens += num_sampled
        if update.kv_utilization is not None:
            stats.peak_kv_utilization = max(stats.peak_kv_utilization, update.kv_utilization)
        if update.kv_usage is not None:
            stats.peak_kv_usage = max(stats.peak_kv_usage, update.kv_usage)
        stats.steps += 1
        stats.step_seconds += seconds
        stats.forward_seconds += forward_seconds
        if self.encoder_cache is not None:
            stats.encoder_seconds = self.runner.encoder_seconds
            stats.encoded_images = self.encoder_cache.encoded_images

    def _fork(self, logits: torch.Tensor, sampling: list[Request],
              forks: list[tuple[Request, list[Request]]]) -> tuple[torch.Tensor, list[Request]]:
        """Make the choices of the n > 1 requests among `sampling` that just computed their
        prompt (appended to `forks`, for the scheduler's update to start them: they share the
        prompt's blocks) and give them rows of their own, copies of their parent's, in the
        logits and the sampling list, so every choice's first token comes from the same prompt
        logits."""
        rows: list[int] = []
        expanded: list[Request] = []
        for row, request in enumerate(sampling):
            rows.append(row)
            expanded.append(request)
            group = request.group
            if group is None or group.forked:
                continue
            self._num_unforked -= 1
            children = []
            for index in range(1, group.n):
                child = Request(
                    request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params, eos_token_ids=request.eos_token_ids,
                    priority=request.priority, arrival_time=request.arrival_time,
                    arrival_order=request.arrival_order, index=index, group=group,
                    num_cached_tokens=request.num_cached_tokens, lora_request=request.lora_request,
                    lora_weights=request.lora_weights, images=request.images)
                self._init_choice_state(child)
                if request.grammar is not None:   # before the first token: the parent's start state
                    child.grammar = request.grammar.fork()
                children.append(child)
            group.choices.extend(children)
            forks.append((request, children))
            rows.extend([row] * len(children))
            expanded.extend(children)
        if len(rows) == len(sampling):
            return logits, sampling
        return logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device)), expanded

    def _end_request(self, request: Request) -> list[RequestOutput]:
        """Abort every unfinished choice of `request` (held for its grammar, waiting, running
        or not forked yet): one `abort` output per choice, the last one `finished`."""
        def end(choice: Request) -> None:
            if self.grammars.unhold(choice):   # never reached the scheduler
                choice.status = RequestStatus.FINISHED_ABORTED
            else:
                self.scheduler.finish(choice, RequestStatus.FINISHED_ABORTED)

        group = request.group
        if group is None:
            end(request)
            return [self._final_output(request, True)]
        ending = [c for c in group.choices if not c.is_finished]
        for choice in ending:
            end(choice)
        # Choices not forked yet end too, with nothing generated.
        missing = range(0)
        if not group.forked:
            self._num_unforked -= 1
            missing = range(len(group.choices), group.n)
            group.forked = True
        count = len(ending) + len(missing)
        outputs = [self._final_output(choice, i == count - 1) for i, choice in enumerate(ending)]
        outputs.extend(RequestOutput(
            request.request_id, [], "", j == count - 1, "abort", num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens, index=index)
            for j, index in enumerate(missing, start=len(ending)))
        group.num_unfinished = 0
        return outputs

    def _release_compiled(self) -> list[RequestOutput]:
        """Schedule the held requests whose grammar compiled; end those whose compile failed."""
        ready, failed = self.grammars.release(idle=not self.scheduler.has_unfinished())
        for request in ready:
            self.scheduler.add(request)
        outputs = []
        for request, reason in failed:
            ended = self._end_request(request)
            for output in ended:
                output.error = reason
            outputs.extend(ended)
            self.requests.pop(request.request_id, None)
        return outputs

    def _final_output(self, request: Request, finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[], text_delta="", finished=finished,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens, num_cached_tokens=request.num_cached_tokens,
            index=request.index)
