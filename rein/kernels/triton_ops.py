"""Triton implementations of the paged-KV-cache kernels (imported only on CUDA).

`rein.kernels` dispatches here for CUDA tensors; each function has the signature and
semantics of its counterpart in `rein.kernels.reference`, the specification:

  store_kv                 -- triton_store.py: scatter new K/V rows into cache slots,
                              quantizing to int8 (+ per token/head scales) for int8 caches.
  paged_decode_attention   -- triton_decode.py: one query token per request, GQA-grouped,
                              split-K over the context with a reduction kernel.
  paged_prefill_attention  -- triton_prefill.py: packed variable-length query chunks,
                              causal against cached prefix + chunk, one launch.

All three accept fp16/bf16/fp32 activations and fp16/bf16/fp32/int8 caches, accumulate in
fp32, validate their arguments (ValueError) before launching, and never synchronize with
the host, so they can be captured in CUDA graphs.
"""

from __future__ import annotations

from rein.kernels.triton_decode import paged_decode_attention
from rein.kernels.triton_prefill import paged_prefill_attention
from rein.kernels.triton_store import store_kv

__all__ = ["paged_decode_attention", "paged_prefill_attention", "store_kv"]
