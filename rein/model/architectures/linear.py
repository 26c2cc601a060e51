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

Once loaded, a CPU float32 model's Linear weights are prepacked (`pack_weights`), and a
bfloat16 model's where the CPU has AVX-512-BF16 or AMX (rein.kernels.cpu_paths.packed_dtypes;
bench/bf16_weights.py: half float32's time, and 0.6-0.94x bfloat16 on dense weights): oneDNN
reorders each weight once into its blocked layout, which it otherwise redoes inside every call.
The packed tensor replaces the dense one (no second copy in memory) and serves every row count.
Measured on the second benchmark machine (Intel Xeon with AVX-512, 1 thread, SmolLM2's 30
layers with weights streamed from memory, best of 4): 8 rows 63-74 -> 53-58 ms, 32 rows 92-102
-> 81-84 ms, 64 rows 127-143 -> 122-142 ms, 2048 rows 3164-3225 -> 3022-3030 ms (MKL's sgemm
there: 2826-2887 ms at 2048 rows but 101-113 at 32; vLLM's CPU build likewise packs for oneDNN).
The embedding table stays dense (a lookup); a tied head gets a packed copy of it
(LlamaFamilyModel.pack_cpu_weights). Everything else -- CUDA, float16, a dtype oneDNN has no
primitive for on this CPU (bfloat16 without AVX-512-BF16 or AMX: rein.kernels.cpu_paths
probes each dtype once), a single row on a dense weight, autograd, REIN_CPU_FAST_PATHS=0 --
keeps `F.linear`; bfloat16 on a CPU without those instructions runs oneDNN on the dense weight.

On CUDA a matmul of at most 64 rows (a decode step) may instead run rein's split-K Triton
kernel (rein.kernels.triton_small_gemm) when REIN_CUDA_SMALL_GEMM=triton, the MLP's down
projection then taking gate_up with SiLU-and-multiply folded in (`silu_and_mul_linear`); the
default is cuBLAS until the device's measurements say otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from rein.core.settings import setting_or_default
from rein.kernels import use_triton
from rein.kernels.cpu_paths import onednn_dtypes, packed_dtypes
from rein.kernels.quantized import CpuPanels, QuantizedWeight, quantized_linear

# Below this many rows F.linear is as fast (a decode step of one or two requests).
MIN_ROWS = 4


# Row count oneDNN tunes a packed layout for; any count runs on it (a decode step's size).
PACK_ROWS_HINT = 32


def pack_weights(model: nn.Module) -> int:
    """Replace every CPU `Linear` weight of `model` in a dtype of `cpu_paths.packed_dtypes()`
    (float32; bfloat16 where the CPU multiplies it in hardware) by oneDNN's packed copy; returns
    how many were packed. For inference only: packed weights take no grad."""
    dtypes = packed_dtypes()
    if not dtypes:
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, Linear) and weight is not None and weight.numel() and not weight.is_mkldnn
                and weight.device.type == "cpu" and weight.dtype in dtypes):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
            module.weight = nn.Parameter(packed, requires_grad=False)
            count += 1
    return count


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight[out, in].T (+ bias): oneDNN on CPU where it pays, else F.linear."""
    if weight.is_mkldnn or (   # packed by pack_weights: oneDNN for every row count
            x.device.type == "cpu" and weight.dtype == x.dtype and x.dtype in onednn_dtypes()
            and x.numel() >= MIN_ROWS * x.shape[-1] and not (torch.is_grad_enabled() and weight.requires_grad)):
        if x.dim() != 2:
            shape = x.shape
            out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, bias, "none", [], "")
            return out.view(*shape[:-1], weight.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if use_triton(x) and cuda_small_gemm() and not (torch.is_grad_enabled() and weight.requires_grad):
        from rein.kernels.triton_small_gemm import small_m_linear

        out = small_m_linear(x, weight, bias)   # None past 64 rows or for a layout it does not take
        if out is not None:
            return out
    return nn.functional.linear(x, weight, bias)


def silu_and_mul_linear(gate_up: torch.Tensor, layer: Linear) -> torch.Tensor | None:
    """layer(silu(gate) * up) in one kernel for a decode step's rows on CUDA when the small-row
    Triton GEMM is selected and `layer` is a plain dense projection (no bias, quantized weight or
    LoRA); None elsewhere: the caller runs silu_and_mul, then the layer."""
    if not (use_triton(gate_up) and cuda_small_gemm() and layer.quantized is None and layer.lora is None
            and layer.bias is None and not (torch.is_grad_enabled() and layer.weight.requires_grad)):
        return None
    from rein.kernels.triton_small_gemm import silu_and_mul_linear as fused

    return fused(gate_up, layer.weight)


@functools.cache
def cuda_small_gemm() -> bool:
    """REIN_CUDA_SMALL_GEMM=triton (rein.core.settings), read once per process
    (`cuda_small_gemm.cache_clear()` re-reads)."""
    return setting_or_default("cuda_small_gemm") == "triton"


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict names) computed by `linear`, or by
    `rein.kernels.quantized.quantized_linear` once loaded with a quantized weight (`quantized`
    set, the float `weight` then an empty stand-in: rein.model.architectures.weights)."""

    quantized: QuantizedWeight | CpuPanels | None = None
    # Set by rein.model.lora.layers on the projections an active LoRA adapter targets: called
    # with (x, out), it adds the step's adapter products into out (None: no LoRA, no cost).
    lora: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized is not None:
            out = quantized_linear(x, self.quantized, self.bias)
        else:
            out = linear(x, self.weight, self.bias)
        if self.lora is not None:
            return self.lora(x, out)
        return out
