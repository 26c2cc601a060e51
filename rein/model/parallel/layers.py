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

Heads are attention's unit: the query heads must split evenly over the N ranks. The KV heads
split evenly too while N divides them; past their count, as vLLM does, they are replicated:
each rank holds one KV head, rank r the head r // (N / num_kv_heads), so N must be a multiple
of num_kv_heads. Either way a rank's query heads are the ones that read its KV heads (GQA's
groups are consecutive query heads). `attention_heads` refuses a size that fits neither; each
rank's attention then sees max(1, num_kv_heads / N) KV heads, which is what its share of the
paged KV cache holds. Replicating costs memory: the N / num_kv_heads ranks of a KV head each
compute and cache it whole, and each holds its K and V projection rows.
"""

from __future__ import annotations

import torch
from torch import nn

from rein.kernels.quantized import CpuPanels, QuantizedWeight
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.spec import ModelSpec


def attention_heads(spec: ModelSpec, world_size: int) -> tuple[int, int]:
    """This rank's (query heads, KV heads) of `spec` split over `world_size` ranks; also the
    KV heads each rank's cache must be sized for (one where the KV heads are replicated)."""
    heads, kv_heads = spec.num_heads, spec.num_kv_heads
    if heads % world_size:
        raise ValueError(f"tensor parallel size {world_size} does not divide the model's {heads} attention heads "
                         f"({kv_heads} KV heads); choose a size that divides the attention heads and divides "
                         f"or is a multiple of the KV heads: {_sizes(heads, kv_heads)}")
    if not _fits_kv(kv_heads, world_size):
        raise ValueError(f"tensor parallel size {world_size} neither divides nor is a multiple of the model's "
                         f"{kv_heads} KV heads: a rank's KV heads must be a whole share of them or one of them "
                         f"replicated ({heads} attention heads); choose one of: {_sizes(heads, kv_heads)}")
    return heads // world_size, max(1, kv_heads // world_size)


def _fits_kv(kv_heads: int, world_size: int) -> bool:
    """Whether `world_size` ranks can hold `kv_heads` KV heads: split evenly or replicated evenly."""
    return kv_heads % world_size == 0 or world_size % kv_heads == 0


def _sizes(heads: int, kv_heads: int) -> str:
    """The tensor-parallel sizes a model of `heads` query and `kv_heads` KV heads can take."""
    return ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0 and _fits_kv(kv_heads, n))


def kv_replicas(spec: ModelSpec, world_size: int) -> int:
    """How many ranks hold each KV head: 1 where the ranks split them, world_size / num_kv_heads
    where they are replicated (consecutive ranks share a head)."""
    attention_heads(spec, world_size)
    return max(1, world_size // spec.num_kv_heads)


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
