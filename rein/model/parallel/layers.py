"""Megatron-style sharding of rein's native models: what each rank holds and computes.

Attention and MLP weights are split so each layer needs one all-reduce after attention and
one after the MLP, and nothing between:

- column-parallel: the fused QKV projection holds this rank's query heads and KV heads
  (its q rows, then its k rows, then its v rows), gate/up this rank's slice of the
  intermediate dimension (its gate rows, then its up rows); their outputs stay split;
- row-parallel: o_proj and down_proj take the matching input columns and produce partial
  sums of the full hidden state, which `all_reduce_` adds up;
- the vocabulary: each rank embeds the token ids in its slice (zeros for the others, summed
  by an all-reduce) and computes its slice of the logits (all-gathered). The vocabulary is
  cut into parts of ceil(vocab / N) rows, so it need not divide; the last rank's missing rows
  are zero and its extra logits are dropped after the gather.

Heads must divide evenly (a head is attention's unit); `attention_heads` refuses a size that
does not. Each rank's attention then sees num_kv_heads / N KV heads, which is what its share
of the paged KV cache holds.
"""

from __future__ import annotations

from math import gcd

import torch
from torch import nn

from rein.kernels.quantized import CpuPanels, QuantizedWeight
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.spec import ModelSpec


def attention_heads(spec: ModelSpec, world_size: int) -> tuple[int, int]:
    """This rank's (query heads, KV heads) of `spec` split over `world_size` ranks; also the
    KV heads each rank's cache must be sized for."""
    if spec.num_heads % world_size or spec.num_kv_heads % world_size:
        common = gcd(spec.num_heads, spec.num_kv_heads)
        sizes = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
        raise ValueError(f"tensor parallel size {world_size} does not divide the model's {spec.num_heads} "
                         f"attention heads and {spec.num_kv_heads} KV heads; choose one that divides both: {sizes}")
    return spec.num_heads // world_size, spec.num_kv_heads // world_size


def split_evenly(size: int, world_size: int, what: str) -> int:
    """`size` / `world_size` for a dimension split across ranks (an MLP's intermediate size)."""
    if size % world_size:
        raise ValueError(f"tensor parallel size {world_size} does not divide the model's {what} ({size})")
    return size // world_size


def vocab_rows(vocab_size: int, world_size: int) -> int:
    """Rows of the vocabulary each rank holds (padded: ceil)."""
    return -(-vocab_size // world_size)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's slice of the vocabulary (all of it on one rank). Loaded
    from a quantized table (a GGUF file's), it keeps the table quantized (`quantized`) and
    dequantizes only the rows it looks up."""

    quantized: QuantizedWeight | CpuPanels | None = None

    def __init__(self, vocab_size: int, hidden_size: int, group: ParallelGroup = SINGLE_RANK) -> None:
        rows = vocab_rows(vocab_size, group.world_size)
        super().__init__(rows, hidden_size)
        self.group = group
        self.vocab_start = group.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.num_embeddings)
        out = self.lookup(local.masked_fill(elsewhere, 0))
        return self.group.all_reduce_(out.masked_fill_(elsewhere.unsqueeze(-1), 0))


    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            return self.quantized.rows_of(ids, self.weight.dtype)
        return nn.functional.embedding(ids, self.weight)

    def head_weight(self) -> torch.Tensor | QuantizedWeight | CpuPanels:
        """The table as a tied output projection's weight."""
        return self.weight if self.quantized is None else self.quantized


def gather_vocab(logits: torch.Tensor, group: ParallelGroup, vocab_size: int) -> torch.Tensor:
    """Every rank's slice of the logits [..., rows] -> the full logits [..., vocab_size]."""
    if group.world_size == 1:
        return logits
    full = group.all_gather(logits)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size].contiguous()
