"""A decode step's decoder layers in one C call on the CPU (csrc/decode_layers_cpu.c).

At batch 1 a quantized model's layers are a few hundred microseconds of arithmetic each, and
the Python forward around them (module calls, torch allocations and views, one ctypes call
per kernel with its checks) was about a quarter of a step. `DecodeLayers` binds a model's
layers once -- their quantized projections, norms and caches as C structs of pointers into the
tensors the model keeps -- and runs a step whose rows are all single-token decodes through
every layer in one call, with the same kernels in the same order.

A model's layers describe themselves (`decode_parts()`, a LayerParts: rein.model.architectures'
Llama-family and Gemma 3 layers on one rank). It applies where every projection is a CpuPanels
or Int8Panels weight with no LoRA adapter on it, the KV cache float32, float16 or bfloat16 (not
int8), the activations float32 on the CPU, and rein's C kernels loaded; elsewhere `bind`
returns None and the model runs its layers as modules. REIN_CPU_FUSED_DECODE=0
(rein.core.settings) turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from rein.core.settings import setting_or_default
from rein.kernels import cpu_native
from rein.kernels.quantized import CpuPanels, Int8Panels

# The model's caches and step metadata (rein.model.attention's LayerCache and AttentionMetadata)
# are read by their fields only: the kernels do not import the model package above them.
LayerCache = Any
AttentionMetadata = Any

i64, p, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class DecodeWeight(ctypes.Structure):
    _fields_ = [("kind", i64), ("q", p), ("scale", p), ("scale_sub", p), ("offset", p), ("offset_sub", p),
                ("bias", p), ("zero", i64), ("n_out", i64), ("cols", i64), ("group", i64), ("block", i64),
                ("bits", i64)]


class DecodeLayer(ctypes.Structure):
    _fields_ = [("qkv", DecodeWeight), ("o", DecodeWeight), ("gate_up", DecodeWeight), ("down", DecodeWeight),
                ("input_norm", p), ("post_attention_norm", p), ("pre_mlp_norm", p), ("post_mlp_norm", p),
                ("q_norm", p), ("k_norm", p), ("k_cache", p), ("v_cache", p), ("kv_type", i64),
                ("block_size", i64), ("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64),
                ("inter", i64), ("window", i64), ("local_rope", i64), ("windowed", i64), ("gelu", i64),
                ("eps", f32), ("scale", f32)]


class DecodeStep(ctypes.Structure):
    _fields_ = [("cos", p * 2), ("sin", p * 2), ("slots", p * 2), ("block_tables", p * 2), ("context_lens", p * 2),
                ("bt_stride", i64 * 2), ("max_context", i64 * 2)]


@functools.cache
def _functions(lib: ctypes.CDLL):
    run = lib.decode_layers_f32
    run.argtypes = [p, i64, p, p, i64, p, ctypes.c_int]
    run.restype = ctypes.c_int
    size = lib.decode_layers_work_floats
    size.argtypes = [p, i64, i64, i64, ctypes.c_int]
    size.restype = i64
    return run, size


def enabled() -> bool:
    """REIN_CPU_FUSED_DECODE (default on), read at each bind."""
    return bool(setting_or_default("cpu_fused_decode"))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _weight(linear, held: list) -> DecodeWeight | None:
    """A Linear's quantized weight as the C struct; None where the fused path cannot run it."""
    w = linear.quantized
    if linear.lora is not None or not isinstance(w, (CpuPanels, Int8Panels)) or w.q.device.type != "cpu":
        return None
    bias = linear.bias
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous()):
        return None
    held.extend((w, bias))
    common = dict(q=_ptr(w.q), scale=_ptr(w.scale), offset=_ptr(w.offset), bias=_ptr(bias), n_out=w.rows,
                  cols=w.cols, group=w.group)
    if isinstance(w, Int8Panels):
        return DecodeWeight(kind=2, block=w.act_block, bits=w.layout_bits, **common)
    if w.packed:
        return DecodeWeight(kind=1, scale_sub=_ptr(w.scale_sub), offset_sub=_ptr(w.offset_sub), zero=w.zero,
                            block=w.block, bits=w.bits, **common)
    return DecodeWeight(kind=0, block=w.group, bits=w.bits, **common)


def _norm(norm, held: list) -> int | None:
    w = norm.weight
    if not (w.dtype == torch.float32 and w.is_contiguous() and w.is_cpu):
        raise _NotFusable
    held.append(w)
    return w.data_ptr()


class _NotFusable(Exception):
    pass


@dataclass
class LayerParts:
    """What the C layer runs, from a model's decoder layer (its `decode_parts()`): the four
    projections (modules with `quantized`, `bias` and `lora`), the norms (modules with `weight`
    and `eps`; None where the layer has none) and the attention's shape.

    The layer computes, for x [T, hidden]:
        h = input_norm(x); q, k, v = qkv(h) (q_norm, k_norm per head); rope; store k, v
        a = o(attention(q)), post_attention_norm(a) where there is one
        x += a; h = pre_mlp_norm(x); x += post_mlp_norm(down(act(gate) * up)) (gate, up = gate_up(h))
    """

    qkv: Any
    o: Any
    gate_up: Any
    down: Any
    input_norm: Any
    pre_mlp_norm: Any
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    scale: float
    activation: str               # "silu" or "gelu_tanh"
    window: int | None = None
    local_rope: bool = False      # the step's second rope (Gemma 3's windowed layers)
    post_attention_norm: Any = None
    post_mlp_norm: Any = None
    q_norm: Any = None
    k_norm: Any = None


class DecodeLayers:
    """A model's decoder layers bound for decode_layers_f32 (see the module docstring)."""

    def __init__(self, caches: list[LayerCache], structs: ctypes.Array, held: list, linears: list) -> None:
        self.caches = [(cache.k, cache.v) for cache in caches]
        self.structs = structs
        self.held = held           # the tensors the structs point into, kept alive
        self.linears = linears     # (module, weight bound): a change unbinds
        self.uses_windowed = any(s.windowed for s in structs)
        self.work = torch.empty(0)

    @classmethod
    def bind(cls, parts: list[LayerParts | None], caches: list[LayerCache]) -> DecodeLayers | None:
        """The layers described by `parts` (one per layer, over its cache) bound, or None where
        one is None or the fused path cannot run it (see the module docstring)."""
        lib = cpu_native.library()
        if lib is None or not enabled() or any(part is None for part in parts):
            return None
        structs = (DecodeLayer * len(parts))()
        held: list = []
        linears: list = []
        try:
            for part, cache, s in zip(parts, caches, structs, strict=True):
                if cache.k_scale is not None or cache.k.dtype not in cpu_native.KV_TYPES or not (
                        cache.k.is_contiguous() and cache.v.is_contiguous() and cache.k.dtype == cache.v.dtype):
                    return None
                for field in ("qkv", "o", "gate_up", "down"):
                    linear = getattr(part, field)
                    weight = _weight(linear, held)
                    if weight is None:
                        return None
                    setattr(s, field, weight)
                    linears.append((linear, linear.quantized))
                norms = [part.input_norm, part.post_attention_norm, part.pre_mlp_norm, part.post_mlp_norm,
                         part.q_norm, part.k_norm]
                if len({norm.eps for norm in norms if norm is not None}) != 1 or (part.q_norm is None) != (
                        part.k_norm is None):
                    return None
                for field, norm in zip(("input_norm", "post_attention_norm", "pre_mlp_norm", "post_mlp_norm",
                                        "q_norm", "k_norm"), norms, strict=True):
                    setattr(s, field, None if norm is None else _norm(norm, held))
                s.eps = part.input_norm.eps
                s.k_cache, s.v_cache = cache.k.data_ptr(), cache.v.data_ptr()
                held.extend((cache.k, cache.v))
                s.kv_type = cpu_native.KV_TYPES[cache.k.dtype]
                s.block_size = cache.k.shape[1]
                s.hidden = part.input_norm.weight.shape[0]
                s.heads, s.kv_heads, s.head_dim, s.inter = part.heads, part.kv_heads, part.head_dim, part.inter
                s.window = part.window or 0
                s.local_rope = int(part.local_rope)
                s.windowed = int(cache.windowed)
                s.gelu = int(part.activation == "gelu_tanh")
                s.scale = part.scale
        except _NotFusable:
            return None
        return cls(caches, structs, held, linears)

    def still_bound(self, caches: list[LayerCache]) -> bool:
        """The same caches, and no projection's weight replaced nor a LoRA adapter set since binding."""
        return (len(caches) == len(self.caches)
                and all(c.k is k and c.v is v for c, (k, v) in zip(caches, self.caches, strict=True))
                and all(linear.lora is None and linear.quantized is weight for linear, weight in self.linears))

    def run(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
            local_rotary: tuple[torch.Tensor, torch.Tensor] | None, meta: AttentionMetadata) -> bool:
        """x [T, hidden] through every layer in place, for a step of T single-token decodes;
        False (x untouched) where the step is not one: the caller runs the layers as modules."""
        rows = x.shape[0]
        if not (rows and meta.num_decode_tokens == rows and not meta.decode_groups and x.dtype == torch.float32
                and x.is_cpu and x.is_contiguous() and len(x.shape) == 2):
            return False
        windowed = meta.windowed if self.uses_windowed else None
        if self.uses_windowed and windowed is None:
            return False
        step = DecodeStep()
        kept = []
        for i, m in enumerate((meta, windowed)):
            if m is None:
                continue
            tables = m.decode_block_tables
            lens = m.decode_context_lens
            if not (tables.dtype == torch.int32 and lens.dtype == torch.int32 and tables.is_contiguous()
                    and lens.is_contiguous() and m.slot_mapping.dtype == torch.int64 and m.slot_mapping.is_contiguous()):
                return False
            step.slots[i], step.block_tables[i], step.context_lens[i] = (
                m.slot_mapping.data_ptr(), tables.data_ptr(), lens.data_ptr())
            step.bt_stride[i], step.max_context[i] = tables.stride(0), m.decode_max_context()
        for i, (cos, sin) in enumerate((rotary, local_rotary or rotary)):
            cos, sin = cos.contiguous(), sin.contiguous()
            kept.extend((cos, sin))
            step.cos[i], step.sin[i] = cos.data_ptr(), sin.data_ptr()
        lib = cpu_native.library()
        run, size = _functions(lib)
        threads = torch.get_num_threads()
        need = size(self.structs, len(self.structs), rows, max(step.max_context[0], step.max_context[1]), threads)
        if self.work.numel() < need:
            self.work = torch.empty(need, dtype=torch.float32)
        rc = run(self.structs, len(self.structs), ctypes.byref(step), x.data_ptr(), rows, self.work.data_ptr(),
                 threads)
        if rc != 0:
            raise RuntimeError(f"decode_layers_f32 failed ({rc}) after changing the step's activations")
        return True


def decode_layers(model: torch.nn.Module, caches: list[LayerCache]) -> DecodeLayers | None:
    """`model`'s layers bound for these caches, each described by its `decode_parts()` (bound at
    first use and kept on the model, bound again when a weight, an adapter or a cache changed);
    None where the fused path does not apply to the model (decided once: a layer without
    decode_parts, or one that returns None)."""
    bound = model.__dict__.get("_decode_layers", False)
    if bound is None:
        return None
    if bound is False or not bound.still_bound(caches):
        parts = [layer.decode_parts() if hasattr(layer, "decode_parts") else None for layer in model.layers]
        bound = model.__dict__["_decode_layers"] = DecodeLayers.bind(parts, caches)
    return bound
