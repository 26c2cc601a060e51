"""Decode steps replayed from CUDA graphs instead of launched kernel by kernel.

A decode-only step of a small or mid-sized model is bound by the host: each layer launches
a few dozen kernels, and Python and PyTorch take longer to launch them than the GPU takes
to run them (on an H200, a 24-layer 0.5B model took 26–29 ms per decode step of 63
requests eagerly, 3.3 ms replaying a graph: bench/attention_kernels.py). A CUDA graph records one
step's launches once and replays them with a single call.

A graph replays fixed shapes and fixed addresses, so `DecodeGraphs` keeps static input
buffers (token ids, positions, cache slots, block tables, context lengths) and records
one graph per batch size in `capture_sizes` (1, 2, 4, 8, then every 8 up to max_num_seqs,
like vLLM). A step of n decodes runs the smallest graph of at least n rows; the rows
past n are padding: slot -1 (the KV store skips it) and context length 0 (attention gives
zeros), and their outputs are dropped. The block table has the full width a request can
reach (max_model_len / block_size) so every step fits; only the columns in use are copied
in, and the kernels read a row no further than its context length.

Sliding-window layers with storage of their own (rein.engine.window_blocks) get a second
slot buffer and block table (`windowed=True`), filled each replay with the step's
translated ids, as the full layers' are; the graph's metadata carries them in
AttentionMetadata.windowed.

Steps with a prefill chunk, and batches larger than the largest graph, run eagerly. So do
CPU engines and `EngineConfig(enforce_eager=True)`. The same buffers and padding can run
eagerly too (`capture=False`): the CPU tests check that path against the plain one.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import nn

from rein.model.attention import AttentionMetadata, LayerCache

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_num_seqs (capped),
    always including the largest, so every decode batch the scheduler can form has one."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8))
    return sorted(set(sizes) | {top})


class DecodeGraphs:
    """Static decode buffers plus one CUDA graph per size (see the module docstring)."""

    def __init__(self, model: nn.Module, caches: list[LayerCache], *, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, capture: bool = True,
                 windowed: bool = False) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        size = self.max_size
        with torch.inference_mode():   # like every tensor of a step (ModelRunner.execute)
            self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
            self.positions = torch.zeros(size, dtype=torch.int64, device=device)
            self.slots = torch.full((size,), -1, dtype=torch.int64, device=device)
            self.context_lens = torch.zeros(size, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros((size, max_blocks_per_seq), dtype=torch.int32, device=device)
            self.windowed_slots = torch.full((size,), -1, dtype=torch.int64, device=device) if windowed else None
            self.windowed_block_tables = torch.zeros_like(self.block_tables) if windowed else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def fits(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_size

    def size_for(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            block_rows: list[list[int]],
            windowed: tuple[list[int], list[list[int]]] | None = None) -> torch.Tensor:
        """The final hidden states [n, hidden] of a decode-only step of n = len(input_ids) rows;
        block_rows are the requests' block ids, each padded to one common width; `windowed`:
        the slots and block rows of the windowed storage (required when it was built with one)."""
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
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:n]
        graph.replay()
        return self.outputs[size][:n]

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

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse the memory the largest one reserved.
        for size in reversed(self.sizes):
            # Warm up on a side stream (compiles the Triton kernels of this shape, and is what
            # PyTorch asks for before a capture); the buffers hold padding, so nothing is stored.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches of %d sizes (1..%d) in %.1f s, %.0f MiB",
                 len(self.sizes), self.max_size, time.perf_counter() - started,
                 (torch.cuda.memory_allocated(self.device) - before) / 2**20)


def _host(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)
