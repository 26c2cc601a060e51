"""Linear layers whose CPU matmuls go through oneDNN instead of the default BLAS.

PyTorch's CPU wheels run `F.linear` on float32 through MKL's sgemm. On the machine rein's
benchmarks ran on (AMD EPYC with AVX-512) that reached about 85 GFLOPS on one core, half of
oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`, what inductor emits for CPU linears),
which ran near the core's AVX-512 peak -- most likely MKL taking its AVX2 path on a non-Intel
CPU (MKL_ENABLE_INSTRUCTIONS=AVX512 and MKL_DEBUG_CPU_TYPE=5 changed nothing). oneDNN took half
the time of `F.linear` for every step shape from 8 rows up: SmolLM2's four projections of one layer,
1 thread, 32 rows 2.6 -> 1.35 ms, 64 rows 5.0 -> 2.4 ms, 2048 rows 152 -> 70 ms
(bench/profile_step.py shows the effect on whole steps). Matmuls are most of a CPU step, so
this is the largest single CPU speed-up. Results are float32 both ways; only the order of the
additions differs (differences of about 1e-7 relative).

oneDNN runs on the dense weight as stored (no prepacking: the weight stays an ordinary tensor,
so loading, state_dict and tied embeddings are unchanged). Everything else -- CUDA, other
dtypes, a single row (where oneDNN's call overhead is larger than its gain), autograd --
keeps `F.linear`.
"""

from __future__ import annotations

import torch
from torch import nn

# Below this many rows F.linear is as fast (a decode step of one or two requests).
MIN_ROWS = 4
_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


ONEDNN = _onednn_available()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias): oneDNN on CPU where it pays, else F.linear."""
    if (ONEDNN and x.device.type == "cpu" and x.dtype in _DTYPES and weight.dtype == x.dtype
            and x.numel() >= MIN_ROWS * x.shape[-1] and not (torch.is_grad_enabled() and weight.requires_grad)):
        if x.dim() != 2:
            shape = x.shape
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
            return out.view(*shape[:-1], weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
