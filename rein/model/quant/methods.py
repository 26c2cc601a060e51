"""Float weights quantized at load, and AWQ / GPTQ checkpoints repacked, into rein's one
quantized format, `rein.kernels.quantized.QuantizedWeight` (w = scale * q + offset per group
of columns; see that module for the layout).

* `quantize_int8` / `quantize_int4`: `--quantization int8 | int4` made from a float weight.
* `awq_weight` / `gptq_weight`: a checkpoint's packed int32 tensors repacked without loss:
  both formats store w = scale * (q - zero), which is rein's form with offset = -scale * zero.
* `read_quantization_config`: which of those a model's config.json asks for, refusing what
  rein cannot read.

The two checkpoint formats, as AutoAWQ / AutoGPTQ / GPTQModel write them (and transformers,
through gptqmodel, and vLLM read them):

    AWQ "gemm"   qweight int32 [in, out / 8]        8 nibbles along the OUTPUT dim, nibble i of
                                                     word c holding column 8c + [0,2,4,6,1,3,5,7][i]
                 qzeros  int32 [in / group, out / 8] packed the same way; zero = nibble
                 scales  fp16  [in / group, out]
    GPTQ         qweight int32 [in / 8, out]        8 nibbles along the INPUT dim, nibble i of
                                                     word r holding input row 8r + i
                 qzeros  int32 [in / group, out / 8] sequential nibbles along the output dim
                 scales  fp16 / bf16 [in / group, out]
                 g_idx   int32 [in]                 group of each input row (act-order permutes it)

GPTQ's "gptq" (v1) checkpoint format stores zero - 1 in qzeros (AutoGPTQ's pack does `zeros -= 1`;
its dequantize adds 1 back); "gptq_v2" (GPTQModel) stores the zero itself. GPTQModel turns v1 into
v2 by adding 0x11111111 to each packed int32 word, the exact inverse of its own v2 -> v1 export
(a packed subtract, which borrows across nibbles where a zero is 0): rein does the same, which for
every zero AutoGPTQ can write without corrupting it (1..15) equals adding 1 to each nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rein.kernels.quantized import NIBBLE_RUN, QuantizedWeight

# AWQ's gemm packing puts output column 8c + AWQ_ORDER[i] in nibble i of word c; column j of a
# word therefore sits in nibble AWQ_REVERSE_ORDER[j] (AutoAWQ's awq/utils/packing_utils.py).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_NIBBLES = 8   # 4-bit values per int32 word
_SHIFTS = tuple(range(0, 32, 4))
# GPTQ v1 -> v2: one added to each nibble of a packed word, carries included (GPTQModel).
_GPTQ_V1_ZERO_ADD = 0x11111111
GPTQ_FORMATS = ("gptq", "gptq_v2")


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Integers 0..15 [N, K] (K a multiple of 32) -> uint8 [N, K / 2] in rein's 4-bit layout:
    within each run of 32 columns, byte j holds column j low and column j + 16 high.
    `QuantizedWeight.integers()` is its exact inverse."""
    if q.dim() != 2 or q.shape[1] % NIBBLE_RUN:
        raise ValueError(f"pack_nibbles: integers of shape {tuple(q.shape)}; want [rows, cols] "
                         f"with cols a multiple of {NIBBLE_RUN}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"pack_nibbles: values {int(q.min())}..{int(q.max())} do not fit 4 bits (0..15)")
    rows = q.shape[0]
    runs = q.reshape(rows, -1, 2, NIBBLE_RUN // 2).to(torch.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, -1).contiguous()


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """A float [N, K] weight as int8, symmetric, one scale per output row (max |w| / 127)."""
    w = _float_matrix(w, "int8")
    rows, cols = w.shape
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    # An all-zero row has scale 0: divide by 1 instead, q = 0 and the row dequantizes to 0.
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(8, q.contiguous(), scale.contiguous(), None, cols, rows, cols, "int8")


def quantize_int4(w: torch.Tensor, group: int | None = 128) -> QuantizedWeight:
    """A float [N, K] weight as 4-bit integers, asymmetric per group of `group` columns
    (scale = (max - min) / 15, offset = min). group -1 or None: one group per row."""
    w = _float_matrix(w, "int4")
    rows, cols = w.shape
    group = cols if group is None or group == -1 else group
    if cols % NIBBLE_RUN:
        raise ValueError(f"int4: weight {tuple(w.shape)} has {cols} columns, not a multiple of "
                         f"{NIBBLE_RUN}; rein's 4-bit weights need that (use int8 for this weight)")
    if group <= 0 or group % NIBBLE_RUN or cols % group:
        raise ValueError(f"int4: group {group} does not suit weight {tuple(w.shape)}: a group must be a "
                         f"multiple of {NIBBLE_RUN} that divides the {cols} columns (e.g. 32, 64, 128; "
                         f"or -1 for one group per row)")
    groups = w.reshape(rows, cols // group, group)
    low = groups.amin(dim=2)
    scale = (groups.amax(dim=2) - low) / 15.0
    # A constant group has scale 0: q = 0 and the group dequantizes to its offset, exactly.
    divisor = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    q = torch.round((groups - low.unsqueeze(-1)) / divisor).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(4, pack_nibbles(q.view(rows, cols)), scale.contiguous(), low.contiguous(),
                           group, rows, cols, f"int4-g{group}")


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, bits: int = 4) -> QuantizedWeight:
    """An AutoAWQ "gemm" linear (qweight [in, out/8], qzeros [in/group, out/8], scales
    [in/group, out]) as rein's [out, in] QuantizedWeight, bit-exact."""
    _require_4_bits("AWQ", bits)
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"AWQ: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} must be 2-D")
    in_features, out_features = qweight.shape[0], qweight.shape[1] * _NIBBLES
    group = _group(group_size, in_features, "AWQ")
    _check_shapes("AWQ", qweight, qzeros, scales, in_features, out_features, group)
    q = _awq_unpack(qweight).t()          # [out, in]
    zero = _awq_unpack(qzeros).t()        # [out, in / group]
    return _affine(q, scales.t(), zero, group, "awq")


def gptq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, group_size: int, bits: int = 4,
                checkpoint_format: str = "gptq") -> QuantizedWeight:
    """An AutoGPTQ / GPTQModel linear (qweight [in/8, out], qzeros [in/group, out/8], scales
    [in/group, out], g_idx [in] or None) as rein's [out, in] QuantizedWeight, bit-exact.
    checkpoint_format "gptq" (v1: qzeros hold zero - 1) or "gptq_v2" (qzeros hold the zero)."""
    _require_4_bits("GPTQ", bits)
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"GPTQ: checkpoint format {checkpoint_format!r}; rein reads "
                         f"{' and '.join(GPTQ_FORMATS)}")
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(f"GPTQ: qweight {tuple(qweight.shape)} and scales {tuple(scales.shape)} must be 2-D")
    in_features, out_features = qweight.shape[0] * _NIBBLES, qweight.shape[1]
    group = _group(group_size, in_features, "GPTQ")
    _check_shapes("GPTQ", qweight, qzeros, scales, in_features, out_features, group)
    if g_idx is not None:
        in_order = torch.arange(in_features, device=g_idx.device) // group
        if g_idx.shape != in_order.shape or not torch.equal(g_idx.to(in_order.dtype), in_order):
            raise ValueError("GPTQ: this weight's g_idx is not in input order: act-order (desc_act=True) "
                             "GPTQ checkpoints are not supported; use a checkpoint quantized with "
                             "desc_act=False (or with static_groups=True)")
    # [in / 8, out] words -> [in / 8, 8, out] nibbles -> input rows 8r + i, then [out, in].
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=qweight.device).view(1, -1, 1)
    q = ((qweight.to(torch.int32).unsqueeze(1) >> shifts) & 0x0F).reshape(in_features, -1).t()
    if checkpoint_format == "gptq":
        # Packed add, as GPTQModel's v1 -> v2 conversion does: int64 so it wraps at 2^32 below.
        qzeros = (qzeros.to(torch.int64) + _GPTQ_V1_ZERO_ADD) & 0xFFFFFFFF
    zero = _unpack_sequential(qzeros).t()                         # [out, in / group]
    return _affine(q, scales.t(), zero, group, "gptq")


@dataclass(frozen=True)
class QuantizationConfig:
    """The part of config.json's `quantization_config` rein acts on.

    method: "awq" or "gptq"; group_size: columns per group, -1 for one group per row;
    checkpoint_format: "gemm" for AWQ, "gptq" (v1) or "gptq_v2" for GPTQ; desc_act: GPTQ's
    act-order flag (`gptq_weight` refuses a weight whose g_idx is permuted, which is what
    matters: act-order with static groups keeps g_idx in order); modules_to_not_convert:
    AWQ's names of layers left in float."""

    method: str
    bits: int
    group_size: int
    checkpoint_format: str
    zero_point: bool = True
    sym: bool = False
    desc_act: bool = False
    modules_to_not_convert: tuple[str, ...] = ()


def read_quantization_config(config: dict) -> QuantizationConfig | None:
    """The quantization a model's config.json (or its `quantization_config` dict itself) asks
    for; None when it has none. ValueError for a method or variant rein cannot read.

    AWQ: 4-bit "gemm" checkpoints with zero points (AutoAWQ's GEMM layer cannot be made
    without them, so zero_point false is refused rather than guessed). GPTQ: 4-bit, checkpoint
    format "gptq" or "gptq_v2"."""
    quant = config if "quant_method" in config else config.get("quantization_config")
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    bits = int(quant.get("bits", 4))
    group_size = int(quant.get("group_size", 128))
    supported = ('rein reads AWQ ("gemm" version) and GPTQ ("gptq" / "gptq_v2" format) checkpoints, '
                 "4-bit; use one of those, or the float model with --quantization int8 | int4")
    if method == "awq":
        version = str(quant.get("version", quant.get("format", "gemm"))).lower()
        if version != "gemm":
            raise ValueError(f'AWQ version "{version}" is not supported: its weights are packed for that '
                             f'kernel. {supported}')
        if not quant.get("zero_point", True):
            raise ValueError(f"AWQ with zero_point false is not supported (AutoAWQ's gemm layers always "
                             f"carry zero points). {supported}")
        _require_4_bits("AWQ", bits, supported)
        return QuantizationConfig("awq", bits, group_size, version, zero_point=True,
                                  modules_to_not_convert=tuple(quant.get("modules_to_not_convert") or ()))
    if method == "gptq":
        fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f'GPTQ checkpoint format "{fmt}" is not supported. {supported}')
        _require_4_bits("GPTQ", bits, supported)
        return QuantizationConfig("gptq", bits, group_size, fmt, sym=bool(quant.get("sym", True)),
                                  desc_act=bool(quant.get("desc_act", False)))
    raise ValueError(f'quantization method "{method or "(none given)"}" is not supported. {supported}')


def _float_matrix(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{what}: want a float [rows, cols] weight, got {w.dtype} {tuple(w.shape)}")
    return w.detach().to(torch.float32)


def _require_4_bits(method: str, bits: int, advice: str = "rein reads 4-bit AWQ and GPTQ checkpoints") -> None:
    if bits != 4:
        raise ValueError(f"{method} with {bits} bits is not supported. {advice}")


def _group(group_size: int | None, cols: int, method: str) -> int:
    group = cols if group_size is None or group_size == -1 else group_size
    if group <= 0 or cols % group:
        raise ValueError(f"{method}: group size {group_size} does not divide the {cols} input features")
    return group


def _check_shapes(method: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  in_features: int, out_features: int, group: int) -> None:
    want_zeros = (in_features // group, out_features // _NIBBLES)
    want_scales = (in_features // group, out_features)
    if out_features % _NIBBLES or tuple(qzeros.shape) != want_zeros or tuple(scales.shape) != want_scales:
        raise ValueError(f"{method}: qweight {tuple(qweight.shape)} (in {in_features}, out {out_features}) "
                         f"and group {group} want qzeros {want_zeros} and scales {want_scales}; got "
                         f"{tuple(qzeros.shape)} and {tuple(scales.shape)} (is group_size right?)")


def _unpack_sequential(words: torch.Tensor) -> torch.Tensor:
    """int32 (or int64 holding 32 bits) [r, c] -> nibbles [r, 8c], nibble i of word j at 8j + i."""
    shifts = torch.tensor(_SHIFTS, dtype=words.dtype, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0x0F).reshape(words.shape[0], -1).to(torch.int32)


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [r, c] -> nibbles [r, 8c] in column order."""
    nibbles = _unpack_sequential(words.to(torch.int32)).view(words.shape[0], -1, _NIBBLES)
    order = torch.tensor(AWQ_REVERSE_ORDER, device=words.device)
    return nibbles.index_select(2, order).reshape(words.shape[0], -1)


def _affine(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, source: str) -> QuantizedWeight:
    """[out, in] integers 0..15, scale and zero [out, in / group] -> w = scale * q - scale * zero.
    Exact in float32: an fp16 / bf16 scale times an integer under 32 is representable."""
    rows, cols = q.shape
    scale = scale.to(torch.float32).contiguous()
    offset = (-scale * zero.to(torch.float32)).contiguous()
    if group % NIBBLE_RUN or cols % NIBBLE_RUN:
        # rein's 4-bit runs need multiples of 32; smaller groups keep their integers a byte each.
        return QuantizedWeight(8, q.to(torch.int8).contiguous(), scale, offset, group, rows, cols, source)
    return QuantizedWeight(4, pack_nibbles(q), scale, offset, group, rows, cols, source)
