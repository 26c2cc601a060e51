"""A layer's element-wise work on CUDA in one Triton kernel each: RMSNorm, the residual add
fused with RMSNorm (residual updated in place), SiLU-and-multiply (GeLU-tanh-and-multiply for
Gemma 3), and rotary in place on the fused Q/K projection.

torch runs each of these as several kernels with a full read and write of the activations in
between (RMSNorm alone: square, mean, add, rsqrt, two multiplies, two casts); at decode sizes a
step is a string of such launches. Each kernel here reads its inputs once and writes once, one
program per row (or per token and head for rotary).

The arithmetic mirrors the torch code in rein.model.architectures.llama and rope (and so Hugging
Face's): statistics and rotations in float32, the normalized value rounded to the activation
dtype before the weight multiplies it, SiLU rounded before the product with `up`, the residual
sum rounded before it is normalized. Launched without host synchronization, so CUDA graphs can
capture them. Tested under the Triton interpreter on CPU (tests/kernels/test_triton_elementwise.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, res_ptr, res_stride, add_ptr, add_stride, w_ptr, out_ptr, out_stride,
                     cols, eps, HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < cols
    if HAS_ADD:
        # residual += add (rounded to the activation dtype, as torch's add), then normalize it
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        a = tl.load(add_ptr + row * add_stride + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + a.to(tl.float32)).to(r.dtype)
        tl.store(res_ptr + row * res_stride + offs, x, mask=mask)
    else:
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + offs, (normed * w).to(x.dtype), mask=mask)


@triton.jit
def _act_and_mul_kernel(gu_ptr, gu_stride, out_ptr, out_stride, inter, GELU_TANH: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gu_ptr + row * gu_stride + offs, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * gu_stride + inter + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    if GELU_TANH:
        # torch's gelu(approximate="tanh"); tanh(y) = 1 - 2 / (1 + exp(2y)) (libdevice's tanh is
        # an extern call, which the interpreter the tests use cannot run).
        y = 0.7978845608028654 * (gf + 0.044715 * gf * gf * gf)
        act = 0.5 * gf * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * y)))
    else:
        act = gf / (1.0 + tl.exp(-gf))
    act = act.to(g.dtype).to(tl.float32)   # rounded before the product, as torch's two ops
    tl.store(out_ptr + row * out_stride + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, token_stride, head_stride, cos_ptr, sin_ptr, half, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    base = x_ptr + token * token_stride + head * head_stride
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0)
    c = tl.load(cos_ptr + token * half + offs, mask=mask, other=0.0)
    s = tl.load(sin_ptr + token * half + offs, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(base + offs, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(base + half + offs, (b * c + a * s).to(x1.dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride, or None."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    return x.reshape(-1, x.shape[-1]) if x.is_contiguous() else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    rows = _rows(x)
    if rows is None or not weight.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2d = out.view(-1, x.shape[-1])
    cols = rows.shape[1]
    _rms_norm_kernel[(rows.shape[0],)](rows, rows.stride(0), rows, 0, rows, 0, weight, out2d, out2d.stride(0),
                                       cols, eps, HAS_ADD=False, BLOCK=triton.next_power_of_2(cols))
    return out


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    res, add = _rows(residual), _rows(x)
    if res is None or add is None or residual.shape != x.shape or not weight.is_contiguous():
        return None
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    out2d = out.view(-1, residual.shape[-1])
    cols = res.shape[1]
    _rms_norm_kernel[(res.shape[0],)](res, 0, res, res.stride(0), add, add.stride(0), weight, out2d, out2d.stride(0),
                                      cols, eps, HAS_ADD=True, BLOCK=triton.next_power_of_2(cols))
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    return _act_and_mul(gate_up, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    return _act_and_mul(gate_up, gelu_tanh=True)


def _act_and_mul(gate_up: torch.Tensor, gelu_tanh: bool) -> torch.Tensor | None:
    if gate_up.dim() != 2 or gate_up.stride(1) != 1:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, gate_up.stride(0), out, out.stride(0), inter,
                                                           GELU_TANH=gelu_tanh, BLOCK=block)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if not (x.dim() == 3 and x.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
            and cos.dtype == torch.float32 and sin.dtype == torch.float32):
        return False
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if tokens == 0:
        return True
    _rotary_kernel[(tokens, heads)](x, x.stride(0), x.stride(1), cos, sin, half,
                                    BLOCK=triton.next_power_of_2(half))
    return True
