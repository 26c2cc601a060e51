"""Applying token bitmasks to logits: -inf wherever a constrained row's grammar forbids a token.

A bitmask row holds ceil(V / 32) int32 words; bit j of word w (little-endian) allows token
32 * w + j, the layout llguidance (and xgrammar) fill. `apply_token_bitmask(logits,
bitmask, rows)` masks logits rows `rows[k]` with bitmask row k, in place, leaving every
other row untouched (unconstrained requests in the same batch):

* CPU (and any device without Triton): torch. Each byte of the mask indexes a 256 x 8
  table of 0 / -inf and the result is added to the rows: one embedding lookup and one
  add, about 1 ms for 32 rows of SmolLM2's 49,152 tokens on one thread (a bool unpack with
  masked_fill_ took 8 ms).
* CUDA: a Triton kernel, one program per (row, block of tokens), reading the words it
  needs and storing -inf where a bit is clear. No host synchronization, so it can sit in
  the step between the forward and the sampler. Tested under TRITON_INTERPRET=1.

Tokens past the bitmask's 32 * words (a vocabulary padded beyond the mask) are forbidden.
"""

from __future__ import annotations

import functools
import sys

import torch

# Bit j of byte b: the byte order of the int32 words must be little-endian for the byte view.
assert sys.byteorder == "little", "token bitmasks are read as little-endian int32 words"

TRITON_BLOCK = 1024


@torch.inference_mode()   # the model runner's logits are inference tensors
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Mask `logits` [B, V] in place: row rows[k] (default: row k) by bitmask row k.

    `bitmask` is int32 [n, words] on any device (a CPU mask is copied to the logits'
    device); n == len(rows)."""
    num = bitmask.shape[0]
    if rows is None:
        rows = list(range(num))
    if num != len(rows):
        raise ValueError(f"the bitmask has {num} rows for {len(rows)} logits rows")
    if num == 0:
        return
    if bitmask.dtype != torch.int32:
        raise ValueError(f"a token bitmask is int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.is_cuda and _triton_available():
        from rein.engine.structured.triton_bitmask import apply_token_bitmask_triton

        apply_token_bitmask_triton(logits, bitmask, rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The torch implementation (the specification the Triton kernel is tested against)."""
    num, vocab = len(rows), logits.shape[1]
    table = _byte_table(logits.device, logits.dtype)
    covered = min(vocab, bitmask.shape[1] * 32)
    # [n, words * 4] bytes -> [n, words * 4, 8] of 0 / -inf -> [n, words * 32] per token.
    penalty = torch.nn.functional.embedding(bitmask.contiguous().view(torch.uint8).long(), table)
    penalty = penalty.view(num, -1)[:, :covered]
    if rows == list(range(logits.shape[0])):
        logits[:, :covered].add_(penalty)
        if covered < vocab:
            logits[:, covered:] = float("-inf")
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    selected = logits.index_select(0, index)
    selected[:, :covered].add_(penalty)
    if covered < vocab:
        selected[:, covered:] = float("-inf")
    logits.index_copy_(0, index, selected)


@functools.cache
def _byte_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 8]: entry (b, k) is 0 when bit k of byte b is set, else -inf."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device=device, dtype=dtype)


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
