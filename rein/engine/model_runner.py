"""Owns the device side of the engine: the model weights, the paged KV cache tensors, and
turning a scheduled step into one forward pass.

A decode-only step replays a CUDA graph (rein.engine.cuda_graphs), which on rank 0 also samples
the step's ids when its rows need nothing the host does (`_choose_graph`): StepResult.sampled;
otherwise the engine's Sampler samples from the logits.

The scheduler hands over requests and how many of their tokens to compute; this module
lays them out (decodes first, then prefill chunks), computes positions and cache slots
from the block tables, runs the model, and returns logits only for the requests that
sample a token this step (plus, for requests asking for prompt logprobs, the scores of
the prompt tokens this step computed: rein.engine.prompt_logprobs).

The blocks themselves belong to the KV cache manager (rein.engine.kv_cache_manager), which
the engine attaches (`attach`); each step this module reads from it what the requests'
block ids do not say: the block copies queued since the last step (the choices of an n > 1
request each need their own copy of the prompt's partly filled last block), made before the
forward, and the windowed block map.

LoRA adapters (EngineConfig.enable_lora): the runner wraps the model in the model side's
adapter slots (rein.model.lora.layers) and keeps them with `LoRASlots` (rein.engine.lora_slots:
the host cache of loaded adapters and which adapter sits in which slot). A step whose requests
use adapters gets them into slots first, and its forward runs inside `LoRAModel.step` with each
token's slot (-1 for base-model tokens). Under tensor parallelism every rank has its slots and
host cache: each reads an adapter as its shard (rein.model.lora.sharding), and the plan tells the
other ranks which adapters rank 0 put in which slot this step (`StepPlan.lora_activations`).

Sliding-window layers get caches of their own when the capacity arithmetic says so
(rein.model.capacity): smaller tensors indexed by windowed blocks, which
rein.engine.window_blocks lends to the logical blocks their windows cover. Each step then
also translates the slots and block tables through that map (AttentionMetadata.windowed).

max_model_len "auto" (EngineConfig): the longest context the KV cache holds, up to the model's
own (rein.model.capacity.fit_max_model_len), said in the load log. On the CPU it is also what
an unset max_model_len does when the model's own context does not fit; on CUDA an unset one
that does not fit is refused, as vLLM does, and the error names `auto`.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import time
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rein.engine.config import EngineConfig
from rein.engine.cuda_graphs import GREEDY, STEP_MODES, DecodeGraphs, GraphSampling, SampledIds
from rein.engine.encoder_cache import EncoderCache
from rein.engine.lora_slots import LoRASlots
from rein.engine.multimodal import step_positions
from rein.engine.options import AUTO
from rein.engine.pooler import gather
from rein.engine.prompt_logprobs import score_prompt_tokens
from rein.engine.request import Request
from rein.engine.sampler import samples_on_device
from rein.engine.scheduler_output import ScheduledRequest
from rein.engine.step_outputs import TokenLogprob
from rein.kernels import cpu_native, cpu_paths, quantized
from rein.model.attention import AttentionMetadata, LayerCache
from rein.model.capacity import KVCapacity, fit_max_model_len, kv_capacity
from rein.model.cpu_allocator import keep_freed_memory
from rein.model.files import ModelFiles
from rein.model.loader import load_model
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.parallel.layers import attention_heads
from rein.model.spec import ModelSpec

if TYPE_CHECKING:
    from rein.engine.kv_cache_manager import KVCacheManager
    from rein.engine.rank_processes import RankProcesses
    from rein.model.lora.request import LoRARequest

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 1024**3
# The CPU attention pads a decode batch to its longest context; splitting the batch into
# this many groups of similar length avoids most of that padding.
DECODE_LENGTH_GROUPS = 4
_END = operator.attrgetter("end")
# Host arrays for the step's index tensors: NumPy makes one from a list of ints some 3x faster
# than torch.tensor does (bench/host_step.py), which at batch 256 is a good share of a step.
_NUMPY_DTYPES = {torch.int64: np.int64, torch.int32: np.int32}


class CapacityError(ValueError):
    """The KV cache cannot hold what the configuration asks for."""


@dataclass
class StepPlan:
    """One step's forward pass as plain lists, built by rank 0 from the scheduled requests and
    run by every rank (rein.engine.rank_processes sends it to the others). Rows: decodes first
    (sorted by context length), then prefill chunks."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]                    # each row's cache slot: block id x block_size + offset
    sample_rows: list[int]              # the rows whose logits are sampled from, in order
    decode_lens: list[int]              # each decode's context length (its position + 1)
    decode_rows: list[list[int]]        # each decode's block ids, padded with 0 to one width
    decode_groups: list[tuple[int, int]] | None
    prefill_lens: list[int]             # each prefill chunk's context length after it
    prefill_new: list[int]              # each prefill chunk's tokens
    prefill_rows: list[list[int]]
    score_rows: list[int] = field(default_factory=list)     # prompt logprobs (rein.engine.prompt_logprobs)
    score_targets: list[int] = field(default_factory=list)
    score_ks: list[int] = field(default_factory=list)
    # The windowed layers' storage (rein.engine.window_blocks), when they have their own.
    windowed_slots: list[int] | None = None
    windowed_decode_rows: list[list[int]] | None = None
    windowed_prefill_rows: list[list[int]] | None = None
    # Block copies queued since the last step (n > 1 forks): every rank makes them before the forward.
    copies: list[tuple[int, int]] = field(default_factory=list)
    windowed_copies: list[tuple[int, int]] | None = None
    # Each row's LoRA slot (-1: the base model); None when no request of the step has an adapter.
    lora_slots: list[int] | None = None
    # The adapters rank 0 put in a slot for this step, (slot, its LoRARequest): every other rank
    # reads each (through its own host cache, as its shard) into the same slot before the forward.
    lora_activations: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # Images (rein.engine.multimodal): rows [row, row + hi - lo) take rows [lo, hi) of the
    # embeddings of the image `item`; M-RoPE prefill chunks' [3, k] positions from row `row` on.
    # Vision models run on one rank, so these never travel to other ranks.
    image_rows: list[tuple[int, Any, int, int]] = field(default_factory=list)
    mrope_rows: list[tuple[int, Any]] = field(default_factory=list)
    # The decode graph mode (rein.engine.cuda_graphs) rank 0 runs this decode-only step with, and
    # every other rank too; None: the step runs eagerly.
    graph_mode: str | None = None


@dataclass
class StepResult:
    logits: torch.Tensor               # [num_sampling, vocab], float32
    sampling: list[Request]            # the requests those rows belong to, in order
    # Prompt logprobs computed this step: (request, index of the first prompt token
    # scored, one entry per token scored from there on); None when no request asked.
    prompt_logprobs: list[tuple[Request, int, list[TokenLogprob]]] | None = None
    # Embedding requests whose prompt this step finished, with their pooled float32 vector
    # (rein.engine.pooler); they have no logits rows.
    pooled: list[tuple[Request, torch.Tensor]] = field(default_factory=list)
    # The sampling rows' ids when the decode graph sampled them (then `logits` is not sampled
    # from again); None: the engine's Sampler samples from `logits`.
    sampled: SampledIds | None = None


@dataclass
class PreparedStep:
    """A step between `ModelRunner.prepare` and `ModelRunner.run`: the plan, what rank 0 reads
    the results by (the sampling requests, prompt-logprob chunks, embedding rows), and whether
    block copies were queued (made by `run`, before the forward)."""

    plan: StepPlan
    local: tuple[list, list, list]
    has_copies: bool
    # What the decode graph samples the step's rows with; None: the engine samples on the host.
    device_sampling: GraphSampling | None = None
    # Async scheduling: (ids, rows, sources), rows whose input id is ids[source], the step
    # before's sampled ids still on the device (`feed`); None: every input id is in the plan.
    fed: tuple[torch.Tensor, list[int], list[int]] | None = None


def decide_max_model_len(spec: ModelSpec, requested: int | str | None) -> int:
    """The context the engine is built for: the requested one, or the model's own for None or
    "auto" (which the KV cache may shorten: ModelRunner)."""
    limit = spec.max_position_embeddings
    if requested is None or requested == AUTO:
        return limit
    if requested > limit:
        raise CapacityError(
            f"max_model_len {requested} is larger than the model supports ({limit} positions); "
            f"use --max-model-len {limit} or less")
    return requested


class ModelRunner:
    """See the module docstring. Under tensor parallelism every rank has one, built with the
    rank's `group`; rank 0's also has `ranks`, the other ranks' processes it sends each step to
    (rein.engine.rank_processes), and the others run `follow` instead of `execute`."""

    def __init__(self, config: EngineConfig, files: ModelFiles, spec: ModelSpec,
                 group: ParallelGroup = SINGLE_RANK, ranks: RankProcesses | None = None) -> None:
        self.config = config
        self.spec = spec
        self.group = group
        self.ranks = ranks
        self.kv_cache: KVCacheManager | None = None   # rank 0's, set by attach()
        # This rank's share of the KV heads, which its cache holds (all of them on one rank; one,
        # a copy of the KV head its query heads read, where the ranks outnumber the KV heads).
        self.cache_spec = dataclasses.replace(spec, num_kv_heads=attention_heads(spec, group.world_size)[1]) \
            if group.world_size > 1 else spec
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.cache_dtype = config.cache_torch_dtype
        self.block_size = config.block_size
        self.max_model_len = decide_max_model_len(spec, config.max_model_len)
        self.model = load_model(files, spec, self.max_model_len, self.dtype, self.device,
                                trust_remote_code=config.trust_remote_code, group=group,
                                quantization=config.quantization)
        if config.quantized_activations == "int8" and self.device.type == "cpu":
            repacked = quantized.with_int8_activations(self.model)
            log.info("int8 activations: %d quantized weights take the int8 kernel", repacked)
        if self.device.type == "cpu":
            # Large step tensors reuse heap memory (rein.model.cpu_allocator) -- from here on,
            # so the load's one-off buffers went back to the system; the log names every fast
            # path this CPU takes (rein.kernels.cpu_paths).
            malloc = "heap reuse" if keep_freed_memory() else "glibc defaults"
            log.info("%s; malloc: %s", cpu_paths.describe(self.dtype), malloc)
        self.capacity = self._size_cache()
        if self.capacity.num_tokens < self.max_model_len:
            if not self._fits_automatically():
                raise CapacityError(
                    f"the KV cache holds {self.capacity.num_tokens} tokens, fewer than max_model_len "
                    f"{self.max_model_len}: give it more memory (kv_cache_memory / gpu_memory_utilization), "
                    f"lower max_model_len, or set it to auto (--max-model-len auto: the most that fits)")
            self._fit_context()
        self.caches = self._allocate_cache()
        # Float32 decode attention on the CPU runs rein's C kernel when it builds (rein.kernels.cpu_native),
        # over a float32, float16 or bfloat16 cache.
        self._native_decode = (self.device.type == "cpu" and self.dtype == torch.float32
                               and self.cache_dtype in cpu_native.KV_TYPES and cpu_native.library() is not None)
        log.info("%s", self.capacity.describe())
        # A vision model's encoder outputs by image (rein.engine.encoder_cache, set by the engine)
        # and the time spent encoding (for the engine's stats).
        self.encoder_cache: EncoderCache | None = None
        self.encoder_seconds = 0.0
        self.lora_model = None
        self.lora: LoRASlots | None = None
        if config.enable_lora:
            self._enable_lora()
        # Decode-only steps replay CUDA graphs (rein.engine.cuda_graphs), which sample on rank 0
        # when the rows let them; everything else, and everything on CPU, runs eagerly.
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.decode_graphs = DecodeGraphs(
                self.model, self.caches, max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=-(-self.max_model_len // self.block_size), device=self.device,
                windowed=self.capacity.num_windowed_blocks > 0,
                vocab_size=spec.vocab_size if group.rank == 0 else None, modes=STEP_MODES)

    def _enable_lora(self) -> None:
        """Give the model `max_loras` adapter slots; adapters are read as requests name them."""
        from rein.model.lora.adapters import load_peft_adapter
        from rein.model.lora.fetch import local_adapter
        from rein.model.lora.layers import enable_lora

        config, model, spec = self.config, self.model, self.spec
        self.lora_model = enable_lora(model, config.max_loras, config.max_lora_rank, self.device, self.dtype)

        def load(lora_request: LoRARequest) -> Any:
            # An s3:// adapter is fetched into the cache once per machine (rein.model.lora.fetch).
            return load_peft_adapter(local_adapter(lora_request.lora_path), model, spec, config.max_lora_rank,
                                     lora_request.base_model_name or config.model)

        self.lora = LoRASlots(load, self.lora_model, config.max_loras, config.cpu_lora_capacity)

    def attach(self, kv_cache: KVCacheManager) -> None:
        """Use the block ids of `kv_cache` (made for this runner's capacity): each step makes the
        block copies it queued and translates through its windowed map. Rank 0 only; the other
        ranks get both with each plan."""
        if kv_cache.num_blocks != self.capacity.num_blocks or \
                (kv_cache.windows is not None) != (self.capacity.num_windowed_blocks > 0):
            raise ValueError(f"the KV cache manager's {kv_cache.num_blocks} blocks do not match this "
                             f"runner's cache ({self.capacity.num_blocks} blocks, "
                             f"{self.capacity.num_windowed_blocks} windowed)")
        self.kv_cache = kv_cache

    def _fits_automatically(self) -> bool:
        """Whether a context the KV cache cannot hold is shortened rather than refused: asked for
        (auto), or on the CPU when max_model_len was left unset (the model's own is often far
        more than the default CPU cache holds)."""
        requested = self.config.max_model_len
        return requested == AUTO or (requested is None and self.device.type == "cpu")

    def _fit_context(self) -> None:
        """max_model_len auto: the longest context whose request the KV cache holds."""
        model_len = self.max_model_len
        self.capacity = self._size_cache(fit=True)
        self.max_model_len = self.capacity.max_model_len
        if self.max_model_len < 1:
            raise CapacityError(
                f"the KV cache holds not one block of {self.block_size} tokens: give it more memory "
                f"(kv_cache_memory / gpu_memory_utilization)")
        log.info("max_model_len auto: %d of the model's %d fit the KV cache%s", self.max_model_len, model_len,
                 "" if self.config.max_model_len == AUTO else " (unset on the CPU: the most that fits)")
        # An API that checks requests against the model's own length accepts longer ones, which
        # then fail here (context_length_exceeded): say how to have them refused up front.
        log.info("requests longer than %d tokens fail on this engine; set REIN_MAX_MODEL_LEN=%d (or @%d in "
                 "REIN_MODELS) for the API too to refuse them when they are sent", self.max_model_len,
                 self.max_model_len, self.max_model_len)

    def _size_cache(self, fit: bool = False) -> KVCapacity:
        """The KV pools the memory gives at max_model_len; `fit`: at the longest context they hold
        up to it (rein.model.capacity.fit_max_model_len)."""
        memory = self.config.kv_cache_memory
        if memory is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                # Leave (1 - utilization) of the whole device for activations and others.
                memory = int(free - total * (1.0 - self.config.gpu_memory_utilization))
            else:
                memory = CPU_DEFAULT_KV_MEMORY
        # Every rank sizes its cache for the block ids rank 0's pool hands out: the least any has.
        memory = self.group.min_int(int(memory))
        if memory <= 0:
            raise CapacityError("no device memory is left for the KV cache after loading the weights")
        size = fit_max_model_len if fit else kv_capacity
        return size(self.cache_spec, int(memory), self.cache_dtype, self.block_size, self.max_model_len,
                    self.config.max_num_seqs, self.config.max_num_batched_tokens)

    def _allocate_cache(self) -> list[LayerCache]:
        capacity = self.capacity
        caches = []
        for window in self.spec.layer_windows:
            windowed = window is not None and capacity.num_windowed_blocks > 0
            num_blocks = capacity.num_windowed_blocks if windowed else capacity.num_blocks
            shape = (num_blocks, self.block_size, self.cache_spec.num_kv_heads, self.spec.head_dim)
            k = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
            if self.cache_dtype == torch.int8:
                scale_shape = shape[:3]
                caches.append(LayerCache(k, v, torch.zeros(scale_shape, dtype=torch.float32, device=self.device),
                                         torch.zeros(scale_shape, dtype=torch.float32, device=self.device),
                                         windowed))
            else:
                caches.append(LayerCache(k, v, windowed=windowed))
        return caches

    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        """Make the block copies the forks queued, run one step's forward pass (on every rank,
        under tensor parallelism) and return what rank 0 samples from: `run(prepare(...))`."""
        return self.run(self.prepare(scheduled))

    def prepare(self, scheduled: list[ScheduledRequest]) -> PreparedStep:
        """The host half of a step: its plan, with the adapters put in slots and the block copies
        the forks queued. Reads the requests, so async scheduling (rein.engine.async_scheduling)
        calls it on the engine's thread while no forward runs; `run` may then go on another."""
        slot_of, activations = self._adapter_slots(scheduled) if self.lora is not None else (None, [])
        plan, local = self._plan(scheduled, slot_of)
        plan.lora_activations = activations
        copies = self.kv_cache.take_copies() if self.kv_cache is not None else None
        if copies is not None:
            plan.copies, plan.windowed_copies = copies
        prepared = PreparedStep(plan, local, copies is not None)
        self._choose_graph(prepared)
        return prepared

    def feed(self, prepared: PreparedStep, previous: StepResult) -> list[tuple[int, int]]:
        """Async scheduling, before the tokens of the step before (`previous`) reach the host: the
        rows of `prepared` whose input id is one of them, as (row, row of `previous`'s sampling),
        their plan's input ids being placeholders. When `previous` sampled in its decode graph and
        `prepared` samples in its own, the graph takes them from the device (`prepared.fed`) and
        this returns []; otherwise the caller writes them into the plan once they are known."""
        position = {id(request): row for row, request in enumerate(previous.sampling)}
        pairs = [(row, position[id(request)]) for row, request in zip(prepared.plan.sample_rows, prepared.local[0],
                                                                       strict=True) if id(request) in position]
        if previous.sampled is None or prepared.device_sampling is None or not pairs:
            return pairs
        prepared.fed = (previous.sampled.device, [row for row, _ in pairs], [source for _, source in pairs])
        return []

    def _choose_graph(self, prepared: PreparedStep) -> None:
        """Whether the step replays a decode graph, and whether the graph samples it: every row
        samples, with nothing the host does between the logits and the ids (a grammar's mask, the
        fork of an n > 1 request, or what `samples_on_device` refuses). Rank 0 decides; the plan
        carries the mode to the other ranks."""
        plan, graphs = prepared.plan, self.decode_graphs
        if plan.prefill_lens or plan.lora_slots is not None or graphs is None \
                or not graphs.fits(len(plan.decode_lens)):
            return
        plan.graph_mode = GREEDY
        sampling = prepared.local[0]
        if len(plan.sample_rows) != len(plan.input_ids):
            return
        for request in sampling:
            if request.grammar is not None or (request.group is not None and not request.group.forked):
                return
        params = [request.sampling_params for request in sampling]
        mode = graphs.mode_for(params) if samples_on_device(params) else None
        if mode is not None:
            plan.graph_mode = mode
            prepared.device_sampling = GraphSampling(params, [request.generator for request in sampling])

    @torch.inference_mode()
    def run(self, prepared: PreparedStep) -> StepResult:
        """The device half of a step: the block copies, the forward (every rank's, under tensor
        parallelism) and the logits; touches no request, only the plan and the device."""
        plan = prepared.plan
        # No forward ran since they were queued, so their sources hold what the fork saw; a
        # block freed and handed out again meanwhile is written by this forward only, after.
        if prepared.has_copies:
            self._copy(plan.copies, plan.windowed_copies)
        sampled = None
        if self.ranks is not None:
            try:
                self.ranks.send(plan)
                hidden, logits, prompt, sampled = self._step(plan, prepared.device_sampling, None, prepared.fed)
                if plan.graph_mode is not None and self.device.type == "cuda":
                    self.ranks.wait_for_device(self.device)
            except RuntimeError as exc:   # a collective that failed: say which rank died, if one did
                raise self.ranks.error_of(exc) from exc
        else:
            embeds = self._image_embeddings(plan) if plan.image_rows else None
            hidden, logits, prompt, sampled = self._step(plan, prepared.device_sampling, embeds, prepared.fed)
        sampling, scoring, pooling = prepared.local
        pooled = gather(hidden, pooling) if pooling else []
        entries = self._prompt_entries(prompt, scoring) if prompt is not None else None
        if logits is None:
            logits = hidden.new_empty((0, self.spec.vocab_size), dtype=torch.float32)
        return StepResult(logits.float(), sampling, entries, pooled, sampled)

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Ranks 1..N-1 of a tensor-parallel engine: rank 0's step on this rank's shard (the
        collectives inside meet rank 0's); the logits rank 0 samples from are discarded here."""
        for slot, lora_request in plan.lora_activations:
            self.lora.place(slot, lora_request)
        if plan.copies:
            self._copy(plan.copies, plan.windowed_copies)
        self._step(plan, None)

    def _step(self, plan: StepPlan, sampling: GraphSampling | None, embeds: dict[str, torch.Tensor] | None = None,
              fed: tuple[torch.Tensor, list[int], list[int]] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, list[TokenLogprob] | None, SampledIds | None]:
        """The plan's hidden states, sampled rows' logits, prompt-logprob entries (each None when
        the plan has none) and, when the decode graph sampled the rows (`sampling`), their ids.
        Every rank calls this alike, so the collectives inside meet. `fed`: PreparedStep's."""
        if plan.graph_mode is None:
            hidden = self._forward(plan, embeds)
            return (hidden, *self._logits(hidden, plan), None)
        step = self.decode_graphs.run(
            plan.input_ids, plan.positions, plan.slots, plan.decode_lens, plan.decode_rows,
            (plan.windowed_slots, plan.windowed_decode_rows) if plan.windowed_slots is not None else None,
            plan.graph_mode, sampling, fed)
        return (step.hidden, *self._logits(step.hidden, plan, step.logits), step.sampled)

    def _adapter_slots(self, scheduled: list[ScheduledRequest]
                       ) -> tuple[dict[int, int] | None, list[tuple[int, LoRARequest]]]:
        """lora_int_id -> slot for the step's adapters, each put in a slot (None: no adapter), and
        the adapters put in a slot just now as (slot, LoRARequest), which the other ranks repeat."""
        requests = {s.request.lora_int_id: s.request for s in scheduled if s.request.lora_request is not None}
        if not requests:
            return None, []
        held = self.lora.active
        slot_of = self.lora.assign({lora_id: request.lora_weights for lora_id, request in requests.items()})
        return slot_of, [(slot, requests[lora_id].lora_request) for lora_id, slot in slot_of.items()
                         if held.get(lora_id) != slot]

    def _plan(self, scheduled: list[ScheduledRequest], slot_of: dict[int, int] | None = None
              ) -> tuple[StepPlan, tuple[list, list, list]]:
        """The step as a StepPlan, and what only rank 0 needs: the requests that sample (in
        logits-row order), the prompt-logprob chunks and the embedding requests' rows.
        `slot_of`: the LoRA slot of each of the step's adapters (None: the step has none)."""
        # Decodes sorted by context length, so similar lengths sit in contiguous rows.
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        for s in scheduled:
            (decodes if s.num_new_tokens == 1 else prefills).append(s)
        decodes.sort(key=_END)
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[Request] = []
        scoring: list[tuple[Request, int, int, int]] = []   # prompt logprobs: see _score_rows
        pooling: list[tuple[Request, int, int, int, int]] = []   # embedding requests' rows
        image_rows: list[tuple[int, Any, int, int]] = []
        mrope_rows: list[tuple[int, Any]] = []

        def add_rows(s: ScheduledRequest) -> None:
            """Any request's rows: images, M-RoPE, pooling and prompt logprobs included."""
            request, start, end = s.request, s.start, s.end
            row_start = len(input_ids)
            blocks = request.block_ids
            images = request.images
            input_ids.extend(request.tokens(start, end))
            span = range(start, end)
            if images is not None and images.mrope_delta:   # prompt rows are set from mrope_rows
                # An M-RoPE request's later tokens are at index + delta on all three axes.
                positions.extend(p + images.mrope_delta for p in span)
            else:
                positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
            if images is not None and start < request.num_prompt_tokens:
                self._plan_images(images, start, end, row_start, image_rows, mrope_rows)
            if request.pooling is not None:
                pooling.append((request, row_start, len(input_ids), start, end))
            elif s.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(request)
            if request.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                scoring.append((request, start, min(end, request.num_prompt_tokens - 1), row_start))

        # The common row, a text request's decode, inline: this loop runs for every request of
        # every step, and at large batch its cost is the step's on the host.
        append_id, append_position, append_slot = input_ids.append, positions.append, slots.append
        for row, s in enumerate(decodes):
            request = s.request
            if request.images is not None or request.pooling is not None or request.prompt_logprobs is not None:
                add_rows(s)
                continue
            start = s.start
            prompt = request.prompt_token_ids
            append_id(prompt[start] if start < len(prompt) else request.output_token_ids[start - len(prompt)])
            append_position(start)
            append_slot(request.block_ids[start // bs] * bs + start % bs)
            if s.samples:
                sample_rows.append(row)
                sampling.append(request)
        for s in prefills:
            add_rows(s)
        lora_slots = None
        if slot_of is not None:
            lora_slots = [slot_of.get(s.request.lora_int_id, -1) for s in decodes]
            for s in prefills:
                lora_slots.extend([slot_of.get(s.request.lora_int_id, -1)] * s.num_new_tokens)

        decode_lens = [s.end for s in decodes]
        plan = StepPlan(
            input_ids=input_ids, positions=positions, slots=slots, sample_rows=sample_rows,
            decode_lens=decode_lens, decode_rows=self._block_rows(decodes) if decodes else [],
            decode_groups=self._decode_groups(decode_lens),
            prefill_lens=[s.end for s in prefills], prefill_new=[s.num_new_tokens for s in prefills],
            prefill_rows=self._block_rows(prefills) if prefills else [], lora_slots=lora_slots,
            image_rows=image_rows, mrope_rows=mrope_rows)
        if scoring:
            plan.score_rows, plan.score_targets, plan.score_ks = self._score_rows(scoring)
        physical = self.kv_cache.window_map if self.kv_cache is not None else None
        if physical is not None:
            plan.windowed_slots = [physical[slot // bs] * bs + slot % bs for slot in slots]
            plan.windowed_decode_rows = _windowed_rows(plan.decode_rows, physical)
            plan.windowed_prefill_rows = _windowed_rows(plan.prefill_rows, physical)
        return plan, (sampling, scoring, pooling)

    @staticmethod
    def _plan_images(images: Any, start: int, end: int, row_start: int, image_rows: list, mrope_rows: list) -> None:
        """Record the image rows and M-RoPE positions of a chunk [start, end) computed from hidden
        row `row_start` on."""
        for item in images.overlapping(start, end):
            lo, hi = max(item.offset, start), min(item.end, end)
            image_rows.append((row_start + lo - start, item, lo - item.offset, hi - item.offset))
        block = step_positions(images, start, end)
        if block is not None:
            mrope_rows.append((row_start, block))

    def _image_embeddings(self, plan: StepPlan) -> dict[str, torch.Tensor]:
        """The embeddings of every image the plan's rows hold, by key: those in the encoder cache
        first (taken before any put can drop them), the others encoded now, in one encoder call,
        and cached."""
        cache = self.encoder_cache
        items = {item.key: item for _, item, _, _ in plan.image_rows}
        found: dict[str, torch.Tensor] = {}
        for key in items:
            value = cache.get(key) if cache is not None else None
            if value is not None:
                found[key] = value
        missing = [item for key, item in items.items() if key not in found]
        if missing:
            started = time.perf_counter()
            inputs = [{name: tensor.to(self.device, non_blocking=True) for name, tensor in item.inputs().items()}
                      for item in missing]
            outputs = self.model.encode_images(inputs)
            for item, output in zip(missing, outputs, strict=True):
                if output.shape[0] != item.length:
                    raise RuntimeError(f"the vision encoder gave {output.shape[0]} embeddings for an image of "
                                       f"{item.length} tokens")
                found[item.key] = output
                if cache is not None:
                    cache.put(item.key, output)
                    cache.encoded_images += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)   # so the encoder's time is its own, not the forward's
            self.encoder_seconds += time.perf_counter() - started
        if cache is not None:   # the embeddings are cached: the pixels can go (made again if ever needed)
            for _, item, _, _ in plan.image_rows:
                item.release()
        return found

    def _forward(self, plan: StepPlan, embeds: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The final hidden states of a step that replays no graph, the model run eagerly.
        `embeds`: the images' embeddings by key."""
        if plan.lora_slots is None:
            return self._eager_forward(plan, embeds)
        # A step with LoRA tokens runs eagerly (`_choose_graph`): the graphs were captured without
        # the adapters' products, and replaying them would drop them. (Simplest correct choice;
        # capturing graphs with the LoRA matmuls is left for later.)
        with self.lora_model.step(torch.tensor(plan.lora_slots, dtype=torch.int64)):
            return self._eager_forward(plan, embeds)

    def _eager_forward(self, plan: StepPlan, embeds: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """The plan's forward, kernel by kernel."""
        windowed = plan.windowed_slots is not None
        decodes, prefills = bool(plan.decode_lens), bool(plan.prefill_lens)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(plan.slots, torch.int64),
            num_decode_tokens=len(plan.decode_lens),
            decode_block_tables=self._table(plan.decode_rows) if decodes else None,
            decode_context_lens=self._tensor(plan.decode_lens, torch.int32) if decodes else None,
            decode_groups=plan.decode_groups,
            prefill_block_tables=self._table(plan.prefill_rows) if prefills else None,
            prefill_cu_seqlens_q=self._tensor(_offsets(plan.prefill_new), torch.int32) if prefills else None,
            prefill_context_lens=self._tensor(plan.prefill_lens, torch.int32) if prefills else None,
            prefill_without_prefix=prefills and plan.prefill_new == plan.prefill_lens,
        )
        if windowed:
            meta.windowed = dataclasses.replace(
                meta, slot_mapping=self._tensor(plan.windowed_slots, torch.int64),
                decode_block_tables=self._table(plan.windowed_decode_rows) if decodes else None,
                prefill_block_tables=self._table(plan.windowed_prefill_rows) if prefills else None)
        input_ids = self._tensor(plan.input_ids, torch.int64)
        if plan.mrope_rows:   # a chunk of an M-RoPE prompt: [3, T] positions (others the same on each axis)
            positions = torch.tensor(plan.positions, dtype=torch.int64).expand(3, -1).clone()
            for row, block in plan.mrope_rows:
                positions[:, row:row + block.shape[1]] = block
            positions = positions.to(self.device, non_blocking=True)
        else:
            positions = self._tensor(plan.positions, torch.int64)
        if not plan.image_rows:
            return self.model(input_ids, positions, self.caches, meta)
        inputs_embeds = self.model.embed_input_ids(input_ids)
        rows = torch.cat([torch.arange(row, row + hi - lo) for row, _, lo, hi in plan.image_rows])
        values = torch.cat([embeds[item.key][lo:hi] for _, item, lo, hi in plan.image_rows])
        inputs_embeds[rows.to(self.device)] = values.to(inputs_embeds.dtype)
        return self.model(input_ids, positions, self.caches, meta, inputs_embeds=inputs_embeds)

    def _logits(self, hidden: torch.Tensor, plan: StepPlan, every_row: torch.Tensor | None = None
                ) -> tuple[torch.Tensor | None, list[TokenLogprob] | None]:
        """The sampled rows' logits and the prompt tokens' logprob entries, each None when the
        plan has none; `every_row`: the logits of every hidden row, when a decode graph made
        them. Every rank calls this alike: compute_logits gathers the vocabulary."""
        prompt = score_prompt_tokens(self.model.compute_logits, hidden, plan.score_rows, plan.score_targets,
                                     plan.score_ks) if plan.score_rows else None
        if not plan.sample_rows:
            return None, prompt
        if len(plan.sample_rows) == hidden.shape[0]:   # every row samples (rows only increase): no gather
            return (self.model.compute_logits(hidden) if every_row is None else every_row), prompt
        rows = self._tensor(plan.sample_rows, torch.int64)
        return (self.model.compute_logits(hidden[rows]) if every_row is None else every_row[rows]), prompt

    @staticmethod
    def _score_rows(scoring: list[tuple[Request, int, int, int]]) -> tuple[list[int], list[int], list[int]]:
        """Prompt logprobs of this step's chunks: the hidden rows to score, the prompt token each
        scores and its top-k. Each `scoring` entry is (request, start, stop, row): positions
        [start, stop) of the request were computed in hidden rows row.. onward, and position p
        scores prompt token p + 1."""
        rows: list[int] = []
        targets: list[int] = []
        ks: list[int] = []
        for request, start, stop, row in scoring:
            rows.extend(range(row, row + stop - start))
            targets.extend(request.prompt_token_ids[start + 1:stop + 1])
            ks.extend([request.sampling_params.prompt_logprobs] * (stop - start))
        return rows, targets, ks

    @staticmethod
    def _prompt_entries(entries: list[TokenLogprob], scoring: list[tuple[Request, int, int, int]]
                        ) -> list[tuple[Request, int, list[TokenLogprob]]]:
        """`entries` (one per scored row, in `_score_rows`' order) split by request chunk."""
        out, offset = [], 0
        for request, start, stop, _ in scoring:
            out.append((request, start + 1, entries[offset:offset + stop - start]))
            offset += stop - start
        return out

    def _copy(self, pairs: list[tuple[int, int]], windowed: list[tuple[int, int]] | None) -> None:
        """One index_copy_ per tensor, on CPU and CUDA alike. The cache tensors keep their
        addresses, so the CUDA graphs stay valid."""
        src = self._tensor([a for a, _ in pairs], torch.int64)
        dst = self._tensor([b for _, b in pairs], torch.int64)
        if windowed:
            windowed_src = self._tensor([a for a, _ in windowed], torch.int64)
            windowed_dst = self._tensor([b for _, b in windowed], torch.int64)
        for cache in self.caches:
            source, target = (windowed_src, windowed_dst) if cache.windowed else (src, dst)
            for tensor in (cache.k, cache.v, cache.k_scale, cache.v_scale):
                if tensor is not None:
                    tensor.index_copy_(0, target, tensor.index_select(0, source))

    def _decode_groups(self, lengths: list[int]) -> list[tuple[int, int]] | None:
        """Row ranges of similar context length for the CPU attention, or None (one batch) when
        grouping saves little padding. The Triton and native CPU kernels handle ragged lengths
        themselves (no padding)."""
        count = len(lengths)
        if self.device.type == "cuda" or count < 4 * DECODE_LENGTH_GROUPS or self._native_decode:
            return None
        size = -(-count // DECODE_LENGTH_GROUPS)
        bounds = [(start, min(start + size, count)) for start in range(0, count, size)]
        grouped = sum((end - start) * lengths[end - 1] for start, end in bounds)
        return bounds if grouped < 0.7 * count * lengths[-1] else None

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A flat list of ints (int64 or int32) as a tensor on the device."""
        return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype])).to(self.device, non_blocking=True)

    def _table(self, rows: list[list[int]]) -> torch.Tensor:
        """Block rows of one width as an int32 [rows, width] tensor on the device."""
        flat = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=len(rows) * len(rows[0]))
        return torch.from_numpy(flat.reshape(len(rows), -1)).to(self.device, non_blocking=True)

    @staticmethod
    def _block_rows(group: list[ScheduledRequest]) -> list[list[int]]:
        """The requests' block ids, each padded with 0 to the longest."""
        rows = [s.request.block_ids for s in group]
        padding = [0] * max(map(len, rows))
        return [row + padding[len(row):] for row in rows]   # new lists: the requests' keep growing


def _windowed_rows(rows: list[list[int]], physical: list[int]) -> list[list[int]]:
    """Block rows translated to the windowed storage; blocks no window holds map to 0
    (the kernels never read a block wholly before a query's window)."""
    return [[max(physical[block], 0) for block in row] for row in rows]


def _offsets(counts: list[int]) -> list[int]:
    """Cumulative offsets [0, c0, c0 + c1, ...] (prefill chunks' first rows, cu_seqlens)."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets
