"""KV-cache sizing arithmetic, shared by the engine (to size its pools) and `rein estimate`.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
(+ one fp32 scale per token, head and K/V for an int8 cache). The pool is a whole number of
blocks; a request of max_model_len tokens needs ceil(max_model_len / block_size) blocks.

A model with sliding-window layers may give those layers storage of their own
(rein.engine.window_blocks): they then keep only the blocks some request's window covers,
at most `windowed_pool_bound` blocks, and the rest of the memory goes to the full-attention
layers' pool, which now costs only their bytes per block. So a Gemma 3 (five windowed
layers to one full) fits about six times the tokens in the same memory, and a model whose
every layer is windowed (Mistral) holds any context: its block pool is bookkeeping only,
with enough block ids for max_num_seqs requests of max_model_len. When the bound does not
fit, or the window spans the whole context, every layer keeps every position as before.

Under tensor parallelism each rank's cache holds its own KV heads (`rank_spec`): num_kv_heads / N
of them, or one where the ranks outnumber the KV heads and replicate them -- so past that count
a rank's cache costs the same as at N = num_kv_heads, and the N ranks together hold
N / num_kv_heads copies of every KV head. `parameters_per_rank` counts one rank's weights.

`fit_max_model_len` is `--max-model-len auto`: the longest context, in whole blocks, whose
request the pools hold (as vLLM's auto: at least one request of that length fits at once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rein.model.parallel.layers import attention_heads, vocab_rows
from rein.model.spec import ModelSpec


@dataclass(frozen=True)
class KVCapacity:
    bytes_per_token: int    # every layer's K/V for one token
    bytes_per_block: int    # a block of the block pool (the full-attention layers' alone with windowed storage)
    num_blocks: int         # the block pool's
    block_size: int
    max_model_len: int
    # Windowed storage (num_windowed_blocks > 0): its window and blocks, which hold the
    # windowed layers' K/V only.
    window: int | None = None
    windowed_bytes_per_block: int = 0
    num_windowed_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens the block pool holds: with windowed storage, what the full-attention layers keep."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_full_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_full_requests(self) -> int:
        """How many requests of max_model_len tokens fit at once."""
        return self.num_blocks // self.blocks_per_full_request

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_windowed_blocks * self.windowed_bytes_per_block

    def describe(self) -> str:
        fit = f"{self.max_full_requests} requests of max_model_len={self.max_model_len} fit at once"
        if not self.num_windowed_blocks:
            return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                    f"({self.total_bytes / 1024**3:.2f} GiB, {self.bytes_per_token} bytes/token); {fit}")
        windowed = (f"sliding-window layers (window {self.window}): {self.num_windowed_blocks} blocks of their "
                    f"own ({self.num_windowed_blocks * self.windowed_bytes_per_block / 1024**3:.2f} GiB), "
                    f"lent to the blocks their windows cover")
        if not self.bytes_per_block:
            return (f"KV cache: every layer is windowed; {windowed}; {self.num_blocks} block ids "
                    f"({self.num_tokens} tokens) for bookkeeping; {fit}")
        return (f"KV cache: full-attention layers: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({self.num_blocks * self.bytes_per_block / 1024**3:.2f} GiB, "
                f"{self.bytes_per_block // self.block_size} bytes/token); {windowed}; {fit}")


def rank_spec(spec: ModelSpec, world_size: int) -> ModelSpec:
    """`spec` as one of `world_size` tensor-parallel ranks sees it: its query and KV heads
    (what its KV cache is sized by), its share of the MLP and experts' widths and of the
    vocabulary (ceil). ValueError for a size the heads refuse (rein.model.parallel.layers)."""
    if world_size == 1:
        return spec
    heads, kv_heads = attention_heads(spec, world_size)
    return dataclasses.replace(
        spec, num_heads=heads, num_kv_heads=kv_heads, vocab_size=vocab_rows(spec.vocab_size, world_size),
        intermediate_size=spec.intermediate_size // world_size,
        moe_intermediate_size=spec.moe_intermediate_size // world_size,
        shared_expert_intermediate_size=spec.shared_expert_intermediate_size // world_size)


def parameters_per_rank(spec: ModelSpec, world_size: int) -> int:
    """The parameters one of `world_size` tensor-parallel ranks holds: its share of the
    projections, experts and vocabulary; the K and V rows of its KV head whole where KV heads
    are replicated; norms and routers on every rank."""
    return rank_spec(spec, world_size).num_parameters()


def windowed_pool_bound(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most windowed blocks running requests hold at once. A step computes positions
    [start, end) of a request, whose queries read from start - window + 1 on: a span of
    window - 1 + (end - start) positions, in at most ceil((window - 1) / block_size) +
    ceil((end - start) / block_size) + 1 blocks. Summed over at most max_num_seqs
    sequences (the choices of an n > 1 request count, and share their prompt's blocks) whose
    new tokens add up to at most max_num_batched_tokens, that is below
    max_num_seqs x (ceil(window / block_size) + 1) + ceil(max_num_batched_tokens / block_size)
    + max_num_seqs. A running request left out of a step holds its window only."""
    per_seq = -(-window // block_size) + 1
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size) + max_num_seqs


def kv_capacity(spec: ModelSpec, memory_bytes: int, cache_dtype: torch.dtype, block_size: int,
                max_model_len: int, max_num_seqs: int | None = None,
                max_num_batched_tokens: int | None = None) -> KVCapacity:
    """The pools `memory_bytes` give. With max_num_seqs and max_num_batched_tokens, a model with
    windowed layers gets windowed storage where that gives its block pool more blocks than
    keeping every position would (see the module docstring)."""
    per_token = spec.kv_bytes_per_token(cache_dtype)
    per_block = per_token * block_size
    alike = KVCapacity(per_token, per_block, memory_bytes // per_block, block_size, max_model_len)
    windows = [window for window in spec.layer_windows if window is not None]
    if not windows or max_num_seqs is None or max_num_batched_tokens is None:
        return alike
    # One storage for all windowed layers, as large as the largest window needs.
    window = max(windows)
    bound = windowed_pool_bound(window, block_size, max_num_seqs, max_num_batched_tokens)
    # The windowed storage pays off when the block pool has more blocks than the bound: then
    # the bound's blocks of windowed layers cost less than a windowed share of every block.
    if window >= max_model_len or alike.num_blocks <= bound:
        return alike
    windowed_per_block = per_block // spec.num_layers * len(windows)
    full_per_block = per_block - windowed_per_block
    if full_per_block == 0:
        # All memory to the windowed blocks (beyond the bound, room for cached prefixes); the
        # block ids cover max_num_seqs requests of max_model_len plus every cached block.
        num_windowed = memory_bytes // windowed_per_block
        num_blocks = max_num_seqs * alike.blocks_per_full_request + num_windowed
    else:
        num_windowed = bound
        num_blocks = (memory_bytes - bound * windowed_per_block) // full_per_block
    return KVCapacity(per_token, full_per_block, num_blocks, block_size, max_model_len, window,
                      windowed_per_block, num_windowed)



def fit_max_model_len(spec: ModelSpec, memory_bytes: int, cache_dtype: torch.dtype, block_size: int,
                      limit: int, max_num_seqs: int | None = None,
                      max_num_batched_tokens: int | None = None) -> KVCapacity:
    """The pools `memory_bytes` give at the longest max_model_len up to `limit` (the model's own)
    that they hold one request of: `limit` when it fits, else the tokens the block pool holds,
    a whole number of blocks. max_model_len 0 (in the answer) means not one block fits.

    A shorter context can change the pools (windowed storage pays off only when the window is
    shorter than the context), so the fit is repeated until it holds; it only ever shrinks."""
    length = limit
    capacity = kv_capacity(spec, memory_bytes, cache_dtype, block_size, length, max_num_seqs, max_num_batched_tokens)
    while capacity.num_tokens < length:
        length = capacity.num_tokens // block_size * block_size
        if length == 0:
            break
        capacity = kv_capacity(spec, memory_bytes, cache_dtype, block_size, length, max_num_seqs,
                               max_num_batched_tokens)
    return capacity if capacity.max_model_len == length else dataclasses.replace(capacity, max_model_len=length)
