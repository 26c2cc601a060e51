"""A mixture-of-experts layer's expert matrices held quantized: `QuantizedExperts`, E matrices
of one shape [rows, cols] in rein's `QuantizedWeight` form (rein.kernels.quantized), and the
routed experts' sum computed on them.

A GGUF file stores each projection of a sparse layer's experts as one 3-D tensor
([n_expert, rows, cols], `blk.N.ffn_gate_exps.weight`); the loader repacks it expert by expert
and stacks the experts on the row dimension, expert e's rows at e * rows ... (e + 1) * rows:

* on CUDA (and wherever no CPU kernel runs) the stacked `QuantizedWeight` is kept as it is, and
  the experts run as rein.kernels.triton_quantized_moe's grouped GEMM over it: the (token,
  expert) pairs sorted by expert, each tile of one expert's pairs multiplied by that expert's
  rows, dequantized tile by tile in registers (vLLM's fused MoE, with weight-only integers);
* on the CPU each expert is repacked once, at load, into the C kernel's `CpuPanels`, and the
  experts run as rein.model.architectures.moe.grouped_experts does with float weights: one
  quantized matmul per expert over the tokens routed to it.

Gate and up of one expert are stacked too ([gate_e; up_e], 2I rows, the order the float
`gate_up_proj` [E, 2I, H] has), so one matmul gives both halves for SiLU-and-multiply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rein.kernels.quantized import CpuPanels, QuantizedWeight, quantized_linear, stack_rows


@dataclass
class QuantizedExperts:
    """E quantized [rows, cols] matrices: `stacked` ([E * rows, cols], expert-major) or, once
    packed for the CPU kernel, `panels` (one per expert); exactly one of the two is set."""

    num_experts: int
    rows: int
    cols: int
    stacked: QuantizedWeight | None = None
    panels: list[CpuPanels] | None = None

    @classmethod
    def of(cls, experts: list[QuantizedWeight]) -> QuantizedExperts:
        """The experts (each [rows, cols], of one format or mixed: stack_rows widens them)."""
        first = experts[0]
        if any(e.shape != first.shape for e in experts):
            raise ValueError(f"experts of different shapes: {sorted({e.shape for e in experts})}")
        return cls(len(experts), first.rows, first.cols, stacked=stack_rows(experts))

    @classmethod
    def gate_up(cls, gate: QuantizedExperts, up: QuantizedExperts) -> QuantizedExperts:
        """Each expert's gate rows then its up rows: [E, 2I, cols], as the float gate_up_proj."""
        if (gate.num_experts, gate.cols) != (up.num_experts, up.cols) or gate.stacked is None or up.stacked is None:
            raise ValueError("gate and up experts must be stacked QuantizedExperts of the same count and columns")
        parts = []
        for e in range(gate.num_experts):
            parts += [gate.expert(e), up.expert(e)]
        return cls(gate.num_experts, gate.rows + up.rows, gate.cols, stacked=stack_rows(parts))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_experts, self.rows, self.cols

    @property
    def source(self) -> str:
        return self.stacked.source if self.stacked is not None else self.panels[0].source

    @property
    def device(self) -> torch.device:
        return self.stacked.device if self.stacked is not None else self.panels[0].device

    def expert(self, e: int) -> QuantizedWeight | CpuPanels:
        """Expert e's [rows, cols] weight (a view of the stacked rows, or its CPU panels)."""
        if self.panels is not None:
            return self.panels[e]
        start = e * self.rows
        return self.stacked.map_rows(lambda t: t[start:start + self.rows], self.rows)

    def to(self, device: torch.device | str) -> QuantizedExperts:
        """On `device`: the CPU gets the C kernel's panels (one expert repacked at a time),
        any other device the stacked form."""
        if torch.device(device).type == "cpu":
            if self.panels is not None:
                return self
            weight = self.stacked.to("cpu")
            panels = [CpuPanels.from_weight(weight.narrow_rows(e * self.rows, self.rows))
                      for e in range(self.num_experts)]
            return QuantizedExperts(self.num_experts, self.rows, self.cols, panels=panels)
        if self.stacked is None:
            raise ValueError("experts packed for the CPU kernel cannot move to another device; load them there")
        return QuantizedExperts(self.num_experts, self.rows, self.cols, stacked=self.stacked.to(device))

    def nbytes(self) -> int:
        """Bytes held: integers, scales and offsets of every expert."""
        if self.panels is not None:
            return sum(p.nbytes() for p in self.panels)
        return self.stacked.nbytes()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [E, rows, cols] tensor."""
        return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.num_experts)])


def check_expert_pair(gate_up: QuantizedExperts, down: QuantizedExperts, hidden: int) -> None:
    """gate_up [E, 2I, H] and down [E, H, I] of one layer."""
    e, two_inter, h = gate_up.shape
    if h != hidden or down.shape != (e, hidden, two_inter // 2):
        raise ValueError(f"quantized experts: gate_up {gate_up.shape} and down {down.shape} do not fit "
                         f"hidden size {hidden}")


def grouped_quantized_experts(x: torch.Tensor, gate_up: QuantizedExperts, down: QuantizedExperts,
                              weights: torch.Tensor, ids: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), as rein.model.architectures.moe.grouped_experts
    with each expert's two matmuls through `quantized_linear` (the C kernel on the CPU): the
    T * k pairs sorted by expert, one matmul per expert that has any, one index_add_ back."""
    check_expert_pair(gate_up, down, x.shape[1])
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.num_experts).tolist()   # host: the loop is over experts
    token_of = order // top_k
    sorted_x = x[token_of]
    out = torch.empty_like(sorted_x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            hidden = silu_and_mul(quantized_linear(sorted_x[rows], gate_up.expert(expert)))
            out[rows] = quantized_linear(hidden, down.expert(expert))
            start += count
    out.mul_(weights.reshape(-1)[order].to(out.dtype).unsqueeze(1))
    return torch.zeros_like(x).index_add_(0, token_of, out)


def triton_quantized_moe_fits(gate_up: QuantizedExperts, down: QuantizedExperts) -> bool:
    """Whether Triton's grouped quantized GEMM takes these experts: stacked, 4- or 8-bit, with
    groups its K-tiles read (whole runs of 32 for 4 bits, 16 columns or more for 8). Others run
    per expert through quantized_linear (a host sync: not inside a CUDA graph)."""
    return all(w.stacked is not None and w.stacked.bits in (4, 8)
               and w.stacked.group % (32 if w.stacked.bits == 4 else 16) == 0 for w in (gate_up, down))
