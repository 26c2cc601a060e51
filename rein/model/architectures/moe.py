"""The sparse mixture-of-experts MLP: a router picks `top_k` of `E` gated-SiLU experts per token.

The experts are stored stacked, as transformers 5 holds them in memory: `gate_up_proj`
[E, 2 * I, H] (gate rows, then up rows) and `down_proj` [E, H, I]. A step's tokens arrive
flattened into one [T, H] batch, and each token's k (token, expert) pairs are computed
grouped by expert rather than token by token:

- on CUDA, Triton's fused MoE (rein.kernels.triton_moe): one grouped GEMM launch over the
  pairs sorted by expert for gate/up, another for down, as vLLM's fused_moe;
- elsewhere `grouped_experts`, its torch reference: the pairs sorted by expert, one matmul
  per expert that has any, and one index_add_ back into the tokens' rows.

Routing is transformers': softmax over all experts in float32, then the top k, renormalised
over those k when the model says so (Mixtral always; Qwen-MoE and OLMoE by
`norm_topk_prob`). Qwen2-MoE adds a shared expert that every token passes through, scaled by
a sigmoid gate.

A GGUF file's experts stay in their quantized blocks (`quantized_gate_up`, `quantized_down`:
rein.kernels.quantized_experts), their matmuls run on the integers per expert.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension
(and the shared expert's), so the routed and shared outputs are partial sums: the block adds
them and all-reduces once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from rein.kernels import elementwise, use_triton
from rein.kernels.quantized_experts import (
    QuantizedExperts,
    grouped_quantized_experts,
    triton_quantized_moe_fits,
)
from rein.model.architectures.linear import Linear, linear
from rein.model.architectures.llama import MLP
from rein.model.parallel.group import SINGLE_RANK, ParallelGroup
from rein.model.parallel.layers import split_evenly
from rein.model.spec import ModelSpec


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    hidden = elementwise.silu_and_mul(gate_up)   # one pass: C on CPU (float32), Triton on CUDA
    if hidden is None:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = nn.functional.silu(gate) * up
    return hidden


def grouped_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) for every token t: x [T, H] -> [T, H].

    The T * k pairs are sorted by expert (stably, so each expert sees its tokens in order)
    and each expert with pairs runs one matmul over its contiguous run; the products are
    scaled by their weights and added back with one index_add_. The additions into a token's
    row go in ascending expert order, as transformers' loop over experts makes them."""
    tokens, top_k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # The per-expert run lengths, read once on the host: the loop below is over experts.
    counts = torch.bincount(flat, minlength=gate_up_proj.shape[0]).tolist()
    token_of = order // top_k
    sorted_x = x[token_of]
    out = torch.empty_like(sorted_x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            hidden = silu_and_mul(linear(sorted_x[rows], gate_up_proj[expert]))
            out[rows] = linear(hidden, down_proj[expert])
            start += count
    out.mul_(weights.reshape(-1)[order].to(out.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token_of, out)


def experts_forward(x: torch.Tensor, gate_up_proj: torch.Tensor | QuantizedExperts,
                    down_proj: torch.Tensor | QuantizedExperts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum for every token: Triton's fused MoE on CUDA, the grouped torch
    path elsewhere; experts held quantized through rein.kernels.quantized_experts (Triton's
    grouped quantized GEMM on CUDA, the C kernel per expert on the CPU)."""
    if isinstance(gate_up_proj, QuantizedExperts):
        if use_triton(x) and isinstance(down_proj, QuantizedExperts) and triton_quantized_moe_fits(gate_up_proj, down_proj):
            from rein.kernels import triton_quantized_moe

            return triton_quantized_moe.fused_quantized_experts(x, gate_up_proj, down_proj, weights, ids)
        return grouped_quantized_experts(x, gate_up_proj, down_proj, weights, ids, silu_and_mul)
    if use_triton(x):
        from rein.kernels import triton_moe

        return triton_moe.fused_experts(x, gate_up_proj, down_proj, weights, ids)
    return grouped_experts(x, gate_up_proj, down_proj, weights, ids)


class SparseMoeBlock(nn.Module):
    """Router, stacked experts and (Qwen2-MoE) the gated shared expert of one sparse layer."""

    def __init__(self, spec: ModelSpec, group: ParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        if spec.hidden_act != "silu":
            raise ValueError(f"activation {spec.hidden_act!r} is not supported (MoE experts use silu)")
        hidden = spec.hidden_size
        inter = split_evenly(spec.moe_intermediate_size, group.world_size, "expert intermediate size")
        self.group = group
        self.top_k = spec.num_experts_per_tok
        self.renormalize = spec.norm_topk_prob
        self.gate = Linear(hidden, spec.num_experts, bias=False)   # the router
        self.gate_up_proj = nn.Parameter(torch.empty(spec.num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(spec.num_experts, hidden, inter))
        # Set at load where the checkpoint's experts stay quantized (a GGUF file's stacked
        # ffn_*_exps): they then replace gate_up_proj and down_proj, left empty.
        self.quantized_gate_up: QuantizedExperts | None = None
        self.quantized_down: QuantizedExperts | None = None
        self.shared_expert = self.shared_expert_gate = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(replace(spec, intermediate_size=spec.shared_expert_intermediate_size), group,
                                     reduce=False)
            self.shared_expert_gate = Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self.quantized_gate_up is not None:
            out = experts_forward(x, self.quantized_gate_up, self.quantized_down, weights, ids)
        else:
            out = experts_forward(x, self.gate_up_proj, self.down_proj, weights, ids)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.group.all_reduce_(out)
