"""Decode steps replayed from CUDA graphs instead of launched kernel by kernel: one graph per
batch size and kind of sampling, from the token ids to the sampled ids.

A decode-only step of a small or mid-sized model is bound by the host: each layer launches
a few dozen kernels, and Python and PyTorch take longer to launch them than the GPU takes
to run them (on an H200, a 24-layer 0.5B model took 26–29 ms per decode step of 63
requests eagerly, 3.3 ms replaying a graph: bench/attention_kernels.py). A CUDA graph records one
step's launches once and replays them with a single call.

A graph replays fixed shapes and fixed addresses, so `DecodeGraphs` keeps static input
buffers (token ids, positions, cache slots, block tables, context lengths) and records
graphs for each batch size in `capture_sizes` (1, 2, 4, 8, then every 8 up to max_num_seqs,
like vLLM). A step of n decodes runs the smallest size of at least n rows; the rows
past n are padding: slot -1 (the KV store skips it) and context length 0 (attention gives
zeros), and their outputs are dropped. The block table has the full width a request can
reach (max_model_len / block_size) so every step fits; only the columns in use are copied
in, and the kernels read a row no further than its context length.

The whole step is in the graph: embedding, layers, final norm, the logits of every row
(float32; gathered over the vocabulary under tensor parallelism) and, on rank 0, the sampled
ids ([size] int64). Sampling keeps rein.engine.sampler's semantics and batch invariance by
running its own tensor code (`race`): greedy rows take the argmax, random rows the exponential
race argmax(x - log q) after temperature and the per-row top-k / top-p / min-p cutoff, where q
is drawn before the replay into a static [size, V] noise buffer, V draws from each row's own
generator (`draw_exponential`, the eager Sampler's draws), so the ids are the eager path's.
Shapes must not depend on the rows, so each size has one graph per mode (`step_mode`): GREEDY
(argmax only), SAMPLE (temperature and the race) and FILTER (every filter on every row, with a
full sort; a row's unused filters leave it unchanged). The knobs of the step's rows go into
static buffers (greedy and padding rows: temperature 1, no filter), and every graph writes its
logits into one shared [max size, V] buffer (kept per graph, they would cost gigabytes at a large
vocabulary). The ids are copied to a
pinned host buffer without blocking, with an event (`SampledIds`): the host waits for that
copy when it reads the tokens, and async scheduling feeds the ids to the next step's graph
on the device (`run(fed=...)`: a gather into the static input ids) without waiting.

Rows the graph cannot sample (logprobs, logit_bias, min_tokens, penalties, a grammar's mask,
an n > 1 fork; rein.engine.model_runner decides, `samples_on_device`) make the step replay the
GREEDY graph and sample on the host from its logits, as do graphs built without `vocab_size`.
Under tensor parallelism every rank captures the same sizes and modes in the same order (their
collectives pair up) and replays the mode rank 0's plan names; only rank 0's graphs sample.

Sliding-window layers with storage of their own (rein.engine.window_blocks) get a second
slot buffer and block table (`windowed=True`), filled each replay with the step's
translated ids, as the full layers' are; the graph's metadata carries them in
AttentionMetadata.windowed.

Steps with a prefill chunk or LoRA tokens, and batches larger than the largest graph, run
eagerly. So do CPU engines and `EngineConfig(enforce_eager=True)`. The same buffers, padding,
knobs and noise can run eagerly too (`capture=False`): the CPU tests check that path against
the plain one.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rein.engine.sampler import (
    argmax_rows,
    draw_exponential,
    filter_knobs,
    is_greedy,
    needs_filters,
    race,
)
from rein.engine.sampling_params import SamplingParams
from rein.model.attention import AttentionMetadata, LayerCache

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256

# The graphs of a batch size, one per kind of sampling the step's rows need (`step_mode`):
# every row greedy (an argmax; also the graph of a step sampled on the host, which reads
# its logits), random rows without filters, and random rows with top-k / top-p / min-p.
GREEDY, SAMPLE, FILTER = "greedy", "sample", "filter"
STEP_MODES = (GREEDY, SAMPLE, FILTER)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (capped),
    always including the largest, so every decode batch the scheduler can form has one."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sorted(set(sizes) | {top})


def step_mode(params: Sequence[SamplingParams]) -> str:
    """The graph that samples rows of these params: GREEDY when every row is greedy, FILTER when
    a random row uses top-k, top-p or min-p (the graph then sorts every row), else SAMPLE."""
    random_rows = [p for p in params if not is_greedy(p)]
    if not random_rows:
        return GREEDY
    return FILTER if any(needs_filters(p) for p in random_rows) else SAMPLE


@dataclass
class GraphSampling:
    """What a whole-step replay samples the step's n rows with: each row's params and
    generator (rein.engine.sampler.SamplingBatch's)."""

    params: list[SamplingParams]
    generators: list[torch.Generator | None]


class SampledIds:
    """Token ids sampled inside a decode graph: `device` ([n] int64, the graph's static output,
    valid until the next replay) and its copy to a host buffer, made without blocking; `tolist`
    waits for that copy only."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor, event: torch.cuda.Event | None) -> None:
        self.device = device
        self._host = host
        self._event = event

    def tolist(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


@dataclass
class DecodeStep:
    """One decode step's results, views of static buffers (read before the next run): the
    final hidden states and logits of the n rows, and their sampled ids when the step sampled
    inside the graph."""

    hidden: torch.Tensor
    logits: torch.Tensor
    sampled: SampledIds | None


class DecodeGraphs:
    """Static decode buffers plus one CUDA graph per size and mode (see the module docstring).

    `vocab_size` set: the graphs sample (rank 0, whose static noise buffer is [max size, V]);
    None: they stop at the logits (the other ranks under tensor parallelism, which capture the
    same `modes` so their collectives pair with rank 0's). `runs` counts the steps run by mode,
    with "device" for those sampled inside the graph."""

    def __init__(self, model: nn.Module, caches: list[LayerCache], *, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, capture: bool = True,
                 windowed: bool = False, vocab_size: int | None = None,
                 modes: Sequence[str] = (GREEDY,)) -> None:
        if not set(modes) <= set(STEP_MODES) or GREEDY not in modes:
            raise ValueError(f"decode graph modes must include {GREEDY!r} and be among {STEP_MODES}, got {modes}")
        self.model = model
        self.caches = caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.modes = tuple(modes)
        self.samples = vocab_size is not None
        size = self.max_size
        with torch.inference_mode():   # like every tensor of a step (ModelRunner.execute)
            self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(size, dtype=torch.int64, device=device)
            self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
            self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros((size, max_blocks_per_seq), dtype=torch.int32, device=device)
            self.windowed_slots = torch.full((size,), -1, dtype=torch.int64, device=device) if windowed else None
            self.windowed_block_tables = torch.zeros_like(self.block_tables) if windowed else None
            if self.samples:
                # Each row's (temperature, top_p, min_p), top_k and greedy flag; greedy and
                # padding rows hold (1, 1, 0), 0 and True, which filter nothing.
                self.knobs = torch.ones((size, 3), dtype=torch.float32, device=device)
                self.top_k = torch.zeros(size, dtype=torch.int64, device=device)
                self.greedy = torch.ones(size, dtype=torch.bool, device=device)
                # The random rows' Exp(1) noise, drawn from their generators before each replay.
                self.noise = torch.ones((size, vocab_size), dtype=torch.float32, device=device)
                # Two host buffers for the sampled ids, taken in turn: async scheduling reads a
                # step's ids while the next step, launched before, copies its own.
                self.host_ids = [torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda")
                                 for _ in range(2)]
                self._host_turn = 0
        # Every size's logits, float32 [max size, V]: one buffer, made by the first step (the
        # largest graph's warm-up), not one per graph (at V ~ 150k and 256 rows, 155 MB each).
        self.logits: torch.Tensor | None = None
        # graphs[size][mode] and its outputs (hidden, logits, sampled ids or None).
        self.graphs: dict[int, dict[str, torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.runs: Counter[str] = Counter()
        if capture:
            self._capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_size

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def mode_for(self, params: Sequence[SamplingParams]) -> str | None:
        """The mode that samples rows of these params inside the graph, or None when these graphs
        do not sample or do not have it."""
        mode = step_mode(params)
        return mode if self.samples and mode in self.modes else None

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            block_rows: list[list[int]],
            windowed: tuple[list[int], list[list[int]]] | None = None,
            mode: str = GREEDY, sampling: GraphSampling | None = None,
            fed: tuple[torch.Tensor, list[int], list[int]] | None = None) -> DecodeStep:
        """A decode-only step of n = len(input_ids) rows through the graph of `mode`; block_rows
        are the requests' block ids, each padded to one common width; `windowed`: the slots and
        block rows of the windowed storage (required when it was built with one). `sampling`:
        sample the n rows inside the graph (`mode` must be `mode_for` their params); None: the
        caller samples from the logits. `fed` (ids, rows, sources): rows `rows` take their input
        id from `ids[sources]`, ids sampled by the step before that are still on the device
        (async scheduling), in place of the placeholders `input_ids` holds for them."""
        n = len(input_ids)
        size = self.size_for(n)
        pad = size - n
        # One host→device copy per buffer, padding included: rows past n may hold the values
        # of an earlier, larger step.
        self.input_ids[:size].copy_(_host(input_ids + [0] * pad, torch.int64), non_blocking=True)
        self.positions[:size].copy_(_host(positions + [0] * pad, torch.int64), non_blocking=True)
        self.slots[:size].copy_(_host(slots + [-1] * pad, torch.int64), non_blocking=True)
        self.context_lens[:size].copy_(_host(context_lens + [0] * pad, torch.int32), non_blocking=True)
        width = len(block_rows[0])
        self.block_tables[:n, :width].copy_(_host(block_rows, torch.int32), non_blocking=True)
        if self.windowed_slots is not None:
            windowed_slots, windowed_rows = windowed
            self.windowed_slots[:size].copy_(_host(windowed_slots + [-1] * pad, torch.int64), non_blocking=True)
            self.windowed_block_tables[:n, :width].copy_(_host(windowed_rows, torch.int32), non_blocking=True)
        if fed is not None:
            ids, rows, sources = fed
            self.input_ids.index_copy_(0, _host(rows, torch.int64).to(self.device, non_blocking=True),
                                       ids.index_select(0, _host(sources, torch.int64).to(self.device,
                                                                                          non_blocking=True)))
            self.runs["fed"] += 1
        if sampling is not None:
            self._set_sampling(sampling, size, mode)
        graph = self.graphs.get(size, {}).get(mode)
        if graph is None:
            hidden, logits, ids = self._step(size, mode)
        else:
            graph.replay()
            hidden, logits, ids = self.outputs[size, mode]
        self.runs[mode] += 1
        sampled = None
        if sampling is not None:
            self.runs["device"] += 1
            sampled = self._to_host(ids[:n])
        return DecodeStep(hidden[:n], logits[:n], sampled)

    def _set_sampling(self, sampling: GraphSampling, size: int, mode: str) -> None:
        """The rows' knobs into the static buffers (padding rows greedy) and their noise drawn."""
        if not self.samples or mode != step_mode(sampling.params):
            raise ValueError(f"these decode graphs cannot sample rows of mode {step_mode(sampling.params)!r} "
                             f"with the graph of {mode!r}")
        vocab = self.noise.shape[1]
        knobs, top_k, greedy = [], [], []
        random_rows, generators = [], []
        for row, (params, generator) in enumerate(zip(sampling.params, sampling.generators, strict=True)):
            if is_greedy(params):
                knobs.append((1.0, 1.0, 0.0))
                top_k.append(0)
                greedy.append(True)
                continue
            temperature, k, p, m = filter_knobs(params, vocab)
            knobs.append((temperature, p, m))
            top_k.append(k)
            greedy.append(False)
            random_rows.append(row)
            generators.append(generator)
        pad = size - len(knobs)
        self.knobs[:size].copy_(torch.tensor(knobs + [(1.0, 1.0, 0.0)] * pad, dtype=torch.float32),
                                non_blocking=True)
        self.top_k[:size].copy_(_host(top_k + [0] * pad, torch.int64), non_blocking=True)
        self.greedy[:size].copy_(torch.tensor(greedy + [True] * pad), non_blocking=True)
        # The same draws as the eager Sampler's: V numbers from each random row's generator.
        draw_exponential(self.noise, random_rows, generators)

    def _to_host(self, ids: torch.Tensor) -> SampledIds:
        host = self.host_ids[self._host_turn][:ids.shape[0]]
        self._host_turn ^= 1
        host.copy_(ids, non_blocking=True)
        event = None
        if ids.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return SampledIds(ids, host, event)

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decode_tokens=size,
            decode_block_tables=self.block_tables[:size], decode_context_lens=self.context_lens[:size],
            decode_groups=None, prefill_block_tables=None, prefill_cu_seqlens_q=None,
            prefill_context_lens=None)
        if self.windowed_slots is not None:
            meta.windowed = dataclasses.replace(meta, slot_mapping=self.windowed_slots[:size],
                                                decode_block_tables=self.windowed_block_tables[:size])
        return self.model(self.input_ids[:size], self.positions[:size], self.caches, meta)

    def _step(self, size: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a graph records: the forward, the logits of every row (float32, gathered over
        the vocabulary under tensor parallelism) and, when these graphs sample, each row's id:
        greedy rows their argmax, random ones the exponential race of rein.engine.sampler with
        the static knobs and noise (SAMPLE without filters, FILTER with all three, which leave
        rows that do not use them unchanged)."""
        hidden = self._forward(size)
        computed = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = torch.empty((self.max_size, computed.shape[1]), dtype=torch.float32, device=self.device)
        logits = self.logits[:size]
        logits.copy_(computed)
        if not self.samples:
            return hidden, logits, None
        if logits.shape[1] != self.noise.shape[1]:
            raise ValueError(f"the model's logits have {logits.shape[1]} columns, the decode graphs' noise "
                             f"{self.noise.shape[1]} (vocab_size)")
        ids = argmax_rows(logits)
        if mode != GREEDY:
            filters = mode == FILTER
            # The noise of greedy and padding rows is stale (and overwritten by the race):
            # their race is computed and thrown away, so every row takes the same kernels.
            raced = race(logits, self.knobs[:size], self.top_k[:size] if filters else None, self.noise[:size],
                         logits.shape[1], need_p=filters, need_min_p=filters)
            ids = torch.where(self.greedy[:size], ids, raced)
        return hidden, logits, ids

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse the memory the largest one reserved. Every
        # rank captures the same sizes and modes in the same order (their collectives pair up).
        for size in reversed(self.sizes):
            self.graphs[size] = {}
            for mode in self.modes:
                # Warm up on a side stream (compiles the Triton kernels of this shape, and is
                # what PyTorch asks for before a capture); the buffers hold padding, so nothing
                # is stored.
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._step(size, mode)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size, mode] = self._step(size, mode)
                self.graphs[size][mode] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches of %d sizes (1..%d), modes %s, in %.1f s, %.0f MiB",
                 len(self.sizes), self.max_size, "/".join(self.modes), time.perf_counter() - started,
                 (torch.cuda.memory_allocated(self.device) - before) / 2**20)


def _host(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)
