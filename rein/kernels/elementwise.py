"""A layer's element-wise work, fused, on whichever device the tensors are: rein's C kernels for
float32 CPU tensors (rein.kernels.cpu_native), Triton kernels on CUDA
(rein.kernels.triton_elementwise). Each function returns None (rotary_: False) where neither
applies, and the caller runs torch's code (rein.model.architectures.llama)."""

from __future__ import annotations

import torch

from rein.kernels import cpu_native, use_triton


def _triton(t: torch.Tensor):
    if not use_triton(t):
        return None
    from rein.kernels import triton_elementwise

    return triton_elementwise


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    if x.device.type == "cpu":
        return cpu_native.rms_norm(x, weight, eps)
    kernels = _triton(x)
    return kernels.rms_norm(x, weight, eps) if kernels else None


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """residual += x in place, then rms_norm(residual); None (nothing changed) where not applicable."""
    if residual.device.type == "cpu":
        return cpu_native.add_rms_norm(residual, x, weight, eps)
    kernels = _triton(residual)
    return kernels.add_rms_norm(residual, x, weight, eps) if kernels else None


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    if gate_up.device.type == "cpu":
        return cpu_native.silu_and_mul(gate_up)
    kernels = _triton(gate_up)
    return kernels.silu_and_mul(gate_up) if kernels else None


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu(gate, approximate="tanh") * up in one pass on CUDA (Gemma 3's MLP); None elsewhere."""
    kernels = _triton(gate_up)
    return kernels.gelu_tanh_and_mul(gate_up) if kernels else None


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate x [tokens, heads, head_dim] in place; False (x untouched) where not applicable."""
    if x.device.type == "cpu":
        return cpu_native.rotary_(x, cos, sin)
    kernels = _triton(x)
    return kernels.rotary_(x, cos, sin) if kernels else False
