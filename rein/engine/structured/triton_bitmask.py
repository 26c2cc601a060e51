"""The Triton kernel that applies token bitmasks on CUDA (see rein.engine.structured.kernels).

One program per (constrained row, block of TRITON_BLOCK tokens): it reads the block's
int32 words of the row's bitmask, extracts each token's bit, and stores -inf into the
logits row `rows[k]` where the bit is clear. Tokens past the mask's coverage read a zero
word, so they are forbidden too. Rows not listed are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.engine.structured.kernels import TRITON_BLOCK


@triton.jit
def _apply_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, covered, logits_stride, bitmask_stride,
                          BLOCK: tl.constexpr):
    k = tl.program_id(0)
    block = tl.program_id(1)
    row = tl.load(rows_ptr + k).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offsets < vocab
    words = tl.load(bitmask_ptr + k * bitmask_stride + offsets // 32, mask=offsets < covered, other=0)
    allowed = ((words >> (offsets % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_stride + offsets, neg_inf.to(logits_ptr.dtype.element_ty),
             mask=in_vocab & (allowed == 0))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """apply_token_bitmask for CUDA tensors (or CPU tensors under TRITON_INTERPRET=1)."""
    if logits.stride(1) != 1:
        raise ValueError("the logits rows must be contiguous")
    bitmask = bitmask.contiguous()
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    row_index = torch.tensor(rows, dtype=torch.int32).to(logits.device, non_blocking=True)
    grid = (len(rows), triton.cdiv(vocab, TRITON_BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, row_index, vocab, covered, logits.stride(0), bitmask.stride(0),
                                BLOCK=TRITON_BLOCK)
