"""KV-cache sizing arithmetic, shared by the engine (to size its pool) and `rein estimate`.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
(+ one fp32 scale per token, head and K/V for an int8 cache). The pool is a whole number of
blocks; a request of max_model_len tokens needs ceil(max_model_len / block_size) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rein.engine.model_spec import ModelSpec


@dataclass(frozen=True)
class KVCapacity:
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    block_size: int
    max_model_len: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_per_full_request(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_full_requests(self) -> int:
        """How many requests of max_model_len tokens fit at once."""
        return self.num_blocks // self.blocks_per_full_request

    def describe(self) -> str:
        gib = self.num_blocks * self.bytes_per_block / 1024**3
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
                f"({gib:.2f} GiB, {self.bytes_per_token} bytes/token); "
                f"{self.max_full_requests} requests of max_model_len={self.max_model_len} fit at once")


def kv_capacity(spec: ModelSpec, memory_bytes: int, cache_dtype: torch.dtype, block_size: int,
                max_model_len: int) -> KVCapacity:
    per_token = spec.kv_bytes_per_token(cache_dtype)
    per_block = per_token * block_size
    return KVCapacity(per_token, per_block, memory_bytes // per_block, block_size, max_model_len)


def weights_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.num_parameters() * torch.empty((), dtype=dtype).element_size()
