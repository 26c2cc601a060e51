"""Weight-only quantized matmuls: one weight format, and `quantized_linear` on whichever device
the weight is (rein's C kernel on the CPU, a Triton kernel on CUDA, torch's dequantize-then-
multiply everywhere else).

Every quantized checkpoint rein keeps quantized -- GGUF's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and
Q6_K blocks, AWQ and GPTQ 4-bit, and `--quantization int8 | int4` made at load -- is repacked
into `QuantizedWeight`, group-wise affine integers:

    w[n, k] = scale[n, k // group] * q[n, k] + offset[n, k // group]      (no offset: 0)

* bits 4: q is unsigned, 0..15, two to a byte. Within each run of 32 columns, byte j holds
  column j in its low nibble and column j + 16 in its high nibble (GGUF's own order), so
  `q` is uint8 [N, K / 2] and a kernel unpacks 32 columns from 16 bytes with two masks.
* bits 8: q is int8 [N, K], -128..127.
* bits 5 and 6 (GGUF's Q5_0, Q5_1, Q5_K, Q6_K): q is unsigned, packed as a nibble plane plus one
  or two 1-bit planes, uint8 [N, K * bits / 8] (rein.kernels.packed_bits), and

      w[n, k] = scale_g[n, k // group] * (q[n, k] - zero) + offset_g[n, k // group]

  with the group's scale the product of a float16 per `block` columns and an int8 per group
  (`scale_sub`; absent: 1), the offset likewise -- GGUF's own two-level scales, so these types
  are held at about their file's size: 0.69 bytes a weight for Q5_0, 0.70 for Q5_K, 0.75 for
  Q5_1, 0.82 for Q6_K (`zero` is 16 for Q5_0, 32 for Q6_K, whose integers are stored unsigned).

For bits 4 and 8, scale and offset are float32 [N, K / group]: GGUF's Q4_K scales a sub-block by
the product of two fp16/6-bit numbers, which float16 cannot hold exactly, and float32 keeps
every source format bit-exact (a repacked weight dequantizes to exactly what gguf's own
dequantize gives). The price is 64 bits per group: 2 bits a weight at group 32. The packed 5-
and 6-bit forms keep the factors instead and multiply them in float32, exact as well.

That row-major form is what checkpoints are repacked into, sharded, stacked and what Triton
reads on CUDA. On the CPU the engine repacks each weight once more, at load, into `CpuPanels`
(the same integers and scales, rows in panels of 16 with each column's 16 side by side), the
layout rein's C kernel multiplies with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from rein.kernels import cpu_native, packed_bits
from rein.kernels.packed_bits import PACKED_BITS

# Columns per packed 4-bit run: 16 bytes, column j low nibble, column j + 16 high nibble.
NIBBLE_RUN = 32


def _apply(fn, tensor: torch.Tensor | None) -> torch.Tensor | None:
    """fn(tensor), passing an absent offset through."""
    return None if tensor is None else fn(tensor)


class _HeldIntegers:
    """What both layouts of a quantized weight answer alike (q, scale, offset; rows, cols)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    @property
    def device(self) -> torch.device:
        return self.q.device

    def nbytes(self) -> int:
        """Bytes held: integers, scales and offsets."""
        return sum(t.numel() * t.element_size() for t in self.held() if t is not None)

    def held(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor indexed by row first: q, scale, offset, scale_sub, offset_sub."""
        return self.q, self.scale, self.offset, self.scale_sub, self.offset_sub

    @property
    def packed(self) -> bool:
        """5- or 6-bit integers in bit planes with two-level float16 x int8 scales."""
        return self.bits in PACKED_BITS

    def _expand(self, top: torch.Tensor | None, sub: torch.Tensor | None, groups: int) -> torch.Tensor | None:
        """A per-block factor times a per-group one -> float32 per group [..., groups] (exact:
        float16 x int8 fits float32's 24 bits)."""
        if top is None:
            return None
        top = top.to(torch.float32)
        if top.shape[-1] != groups:
            top = top.repeat_interleave(groups // top.shape[-1], dim=-1)
        return top if sub is None else top * sub.to(torch.float32)


@dataclass
class QuantizedWeight(_HeldIntegers):
    """A [rows, cols] weight matrix as group-wise affine integers (see the module docstring)."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    rows: int
    cols: int
    source: str = ""   # what it was repacked from ("Q4_K", "int8", "awq", ...), for the load log
    # Packed 5/6-bit forms only (see the module docstring): the integer subtracted before
    # scaling, the columns per float16 scale / offset entry (0: the group), and the int8
    # per-group factors of scale and offset.
    zero: int = 0
    block: int = 0
    scale_sub: torch.Tensor | None = None
    offset_sub: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.bits not in (4, 5, 6, 8):
            raise ValueError(f"quantized weight: {self.bits} bits (rein keeps 4, 5, 6 or 8)")
        self.block = self.block or self.group
        if self.cols % self.group:
            raise ValueError(f"quantized weight: {self.cols} columns are not whole groups of {self.group}")
        if self.bits == 4 and (self.group % NIBBLE_RUN or self.cols % NIBBLE_RUN):
            raise ValueError(f"4-bit weight: group {self.group} and columns {self.cols} must be "
                             f"multiples of {NIBBLE_RUN}")
        if self.packed:
            _check_packed_form(self)
        elif self.zero or self.block != self.group or self.scale_sub is not None or self.offset_sub is not None:
            raise ValueError(f"{self.bits}-bit weight: zero, block and per-group factors are for the packed "
                             f"5- and 6-bit forms only")
        want_q = (self.rows, self.cols * self.bits // 8)
        want_s = (self.rows, self.cols // self.block)
        if tuple(self.q.shape) != want_q or tuple(self.scale.shape) != want_s or (
                self.offset is not None and tuple(self.offset.shape) != want_s):
            raise ValueError(f"quantized weight [{self.rows}, {self.cols}] group {self.group}: q "
                             f"{tuple(self.q.shape)} (want {want_q}), scale {tuple(self.scale.shape)} (want {want_s})")
        want_sub = (self.rows, self.cols // self.group)
        for name, sub in (("scale_sub", self.scale_sub), ("offset_sub", self.offset_sub)):
            if sub is not None and tuple(sub.shape) != want_sub:
                raise ValueError(f"quantized weight [{self.rows}, {self.cols}] group {self.group}: {name} "
                                 f"{tuple(sub.shape)} (want {want_sub})")

    def integers(self) -> torch.Tensor:
        """q as one int32 [rows, cols] (4-bit runs and 5/6-bit planes unpacked; `zero` not subtracted)."""
        if self.bits == 8:
            return self.q.to(torch.int32)
        if self.packed:
            return packed_bits.unpack_rows(self.q, self.bits, self.rows, self.cols)
        runs = self.q.view(self.rows, self.cols // NIBBLE_RUN, NIBBLE_RUN // 2).to(torch.int32)
        return torch.cat([runs & 0x0F, runs >> 4], dim=2).view(self.rows, self.cols)

    def group_scales(self) -> torch.Tensor:
        """Each group's scale, float32 [rows, cols / group]."""
        return self._expand(self.scale, self.scale_sub, self.cols // self.group)

    def group_offsets(self) -> torch.Tensor | None:
        """Each group's offset, float32 [rows, cols / group]; None without one."""
        return self._expand(self.offset, self.offset_sub, self.cols // self.group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [rows, cols] weight."""
        ints = self.integers() - self.zero if self.zero else self.integers()
        groups = ints.view(self.rows, -1, self.group).to(torch.float32)
        w = groups * self.group_scales().unsqueeze(-1)
        offset = self.group_offsets()
        if offset is not None:
            w += offset.unsqueeze(-1)
        return w.view(self.rows, self.cols).to(dtype)

    def map_rows(self, fn, rows: int | None = None) -> QuantizedWeight:
        """The weight with `fn` applied to q, its scales and offsets alike (an operation on rows)."""
        return replace(self, q=fn(self.q), scale=fn(self.scale), offset=_apply(fn, self.offset),
                       scale_sub=_apply(fn, self.scale_sub), offset_sub=_apply(fn, self.offset_sub),
                       rows=self.rows if rows is None else rows)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self.map_rows(lambda t: t.to(device))

    def narrow_rows(self, start: int, length: int) -> QuantizedWeight:
        """Rows start..start+length (a tensor-parallel shard of the output dimension)."""
        return self.map_rows(lambda t: t[start:start + length].contiguous(), length)

    def narrow_cols(self, start: int, length: int) -> QuantizedWeight | None:
        """Columns start..start+length (a shard of the input dimension); None where the cut
        is not on group, scale block (and packed run) boundaries."""
        unit = max(self.block, packed_bits.RUN) if self.packed else self.group
        if start % unit or length % unit:
            return None
        q = self.q[:, start * self.bits // 8:(start + length) * self.bits // 8].contiguous()

        def cut(t, per):
            return _apply(lambda v: v[:, start // per:(start + length) // per].contiguous(), t)

        return replace(self, q=q, scale=cut(self.scale, self.block), offset=cut(self.offset, self.block),
                       scale_sub=cut(self.scale_sub, self.group), offset_sub=cut(self.offset_sub, self.group),
                       cols=length)

    def padded_rows(self, rows: int) -> QuantizedWeight:
        """Zero rows appended up to `rows` (a vocabulary shard past the vocabulary's end)."""
        extra = rows - self.rows
        return self.map_rows(lambda t: torch.cat([t, t.new_zeros(extra, *t.shape[1:])]), rows)

    def permute_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """Rows reordered: row i of the result is row order[i]."""
        return self.map_rows(lambda t: t.index_select(0, order).contiguous())

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense rows `ids` (an embedding lookup on a quantized table): [*ids.shape, cols]."""
        flat = ids.reshape(-1)
        part = self.map_rows(lambda t: t.index_select(0, flat), flat.numel())
        return part.dequantize(dtype).view(*ids.shape, self.cols)


def _check_packed_form(w: QuantizedWeight) -> None:
    """What the packed 5/6-bit kernels assume: whole 32-column runs, groups of 16 or more (the
    Triton kernel's K-tile), blocks of whole groups, float16 scales and int8 factors."""
    run = packed_bits.RUN
    if w.cols % run or w.group % 16 or w.block % w.group or w.cols % w.block:
        raise ValueError(f"{w.bits}-bit weight: columns {w.cols} must be whole runs of {run} and whole "
                         f"blocks of {w.block}; group {w.group} a multiple of 16 dividing the block")
    for name, t in (("scale", w.scale), ("offset", w.offset)):
        if t is not None and t.dtype != torch.float16:
            raise ValueError(f"{w.bits}-bit weight: {name} is {t.dtype}; the packed forms keep float16")
    for name, t in (("scale_sub", w.scale_sub), ("offset_sub", w.offset_sub)):
        if t is not None and t.dtype != torch.int8:
            raise ValueError(f"{w.bits}-bit weight: {name} is {t.dtype}; the packed forms keep int8")
    if w.offset_sub is not None and w.offset is None:
        raise ValueError(f"{w.bits}-bit weight: offset_sub without an offset")
    if not 0 <= w.zero < 1 << w.bits:
        raise ValueError(f"{w.bits}-bit weight: zero {w.zero} is outside 0..{(1 << w.bits) - 1}")


def widened(weight: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same weight as 8-bit integers in groups of `group` (a divisor of its group), float32
    scales repeated: how weights of different formats are stacked into one fused matrix. The
    8-bit form holds any 4-, 5- or 6-bit weight exactly (q - zero fits int8)."""
    if weight.group % group:
        raise ValueError(f"cannot regroup a group of {weight.group} into groups of {group}")
    repeat = weight.group // group
    if weight.bits == 8:
        q = weight.q
    else:
        q = (weight.integers() - weight.zero).to(torch.int8)

    def spread(t):
        return _apply(lambda s: s.repeat_interleave(repeat, dim=1).contiguous(), t)

    return QuantizedWeight(8, q.contiguous(), spread(weight.group_scales()), spread(weight.group_offsets()), group,
                           weight.rows, weight.cols, weight.source)


def _same_form(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    """Whether two weights' tensors can be concatenated row-wise as they are."""
    def kinds(w):
        return tuple(None if t is None else t.dtype for t in w.held()[1:])

    return (a.bits, a.group, a.block, a.zero, kinds(a)) == (b.bits, b.group, b.block, b.zero, kinds(b))


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights with the same columns stacked on the row dimension (fused q/k/v, gate/up).
    Parts of one format stack as they are; mixed formats are widened to 8 bits and the
    smallest group first (what a GGUF "_M" file's mixed layers need)."""
    first = parts[0]
    if any(p.cols != first.cols for p in parts):
        raise ValueError("stacked weights must have the same number of columns")
    if any(not _same_form(p, first) for p in parts):
        group = min(p.group for p in parts)
        parts = [widened(p, group) for p in parts]
        if any(p.offset is None for p in parts) and any(p.offset is not None for p in parts):
            parts = [p if p.offset is not None else _with_zero_offset(p) for p in parts]
        first = parts[0]
    sources = ",".join(sorted({p.source for p in parts if p.source}))

    def cat(field):
        tensors = [getattr(p, field) for p in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return replace(first, q=cat("q"), scale=cat("scale"), offset=cat("offset"), scale_sub=cat("scale_sub"),
                   offset_sub=cat("offset_sub"), rows=sum(p.rows for p in parts), source=sources)


def _with_zero_offset(weight: QuantizedWeight) -> QuantizedWeight:
    return replace(weight, offset=torch.zeros_like(weight.scale))


def reference_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols] @ w.T (+ bias) by dequantizing w first: the definition the kernels are tested against."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


# The CPU kernel's panels: rows in groups of 16, each column's 16 integers side by side
# (csrc/quantized_matmul_cpu.c). Repacked once per weight; in slices of this many rows, so the
# repacking's int32 temporaries stay small even for a 262k-row embedding.
PANEL = 16
PACK_SLICE_ROWS = 4096


@dataclass
class CpuPanels(_HeldIntegers):
    """A QuantizedWeight in the CPU kernel's panel layout (same values; see the C file):
    q [panels, cols, 16] int8 or [panels, cols, 8] uint8 (byte j: row j low, row j + 8 high),
    or for 5/6 bits uint8 [panels, cols * 2 * bits] (those nibbles, then a 16-bit plane a column
    per high bit: rein.kernels.packed_bits); scale and offset [panels, cols / block, 16] (float32,
    float16 for 5/6 bits), scale_sub and offset_sub [panels, cols / group, 16] int8; the last
    panel's missing rows zero."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    rows: int
    cols: int
    source: str = ""
    zero: int = 0
    block: int = 0
    scale_sub: torch.Tensor | None = None
    offset_sub: torch.Tensor | None = None
    # The C kernel's call with this weight's pointers bound (rein.kernels.cpu_native.matmul_kernel).
    kernel: Callable | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.block = self.block or self.group

    @classmethod
    def from_weight(cls, weight: QuantizedWeight) -> CpuPanels:
        panels = -(-weight.rows // PANEL)
        if weight.packed:   # nibbles, then bit planes, per panel (rein.kernels.packed_bits)
            q = torch.empty(panels, weight.cols * PANEL * weight.bits // 8, dtype=torch.uint8)
        else:
            q = torch.empty(panels, weight.cols, PANEL * weight.bits // 8,
                            dtype=torch.int8 if weight.bits == 8 else torch.uint8)

        def panel_tensor(t):
            return _apply(lambda v: torch.zeros(panels, v.shape[1], PANEL, dtype=v.dtype), t)

        held = [panel_tensor(t) for t in weight.held()[1:]]
        for start in range(0, weight.rows, PACK_SLICE_ROWS):
            part = weight.narrow_rows(start, min(PACK_SLICE_ROWS, weight.rows - start))
            p0, count = start // PANEL, -(-part.rows // PANEL)
            pad = count * PANEL - part.rows
            ints = torch.nn.functional.pad(part.integers(), (0, 0, 0, pad)).view(count, PANEL, -1).transpose(1, 2)
            if weight.bits == 8:
                q[p0:p0 + count] = ints.to(torch.int8)
            elif weight.packed:
                q[p0:p0 + count] = packed_bits.pack_panels(ints, weight.bits)
            else:
                q[p0:p0 + count] = (ints[..., :8] | (ints[..., 8:] << 4)).to(torch.uint8)
            for mine, theirs in zip(held, part.held()[1:], strict=True):
                if mine is not None:
                    padded = torch.nn.functional.pad(theirs, (0, 0, 0, pad))
                    mine[p0:p0 + count] = padded.view(count, PANEL, -1).transpose(1, 2)
        scale, offset, scale_sub, offset_sub = held
        return cls(weight.bits, q, scale, offset, weight.group, weight.rows, weight.cols, weight.source,
                   weight.zero, weight.block, scale_sub, offset_sub)

    def _integers(self, panels: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
        """The integers of rows (panel, lane) -> int32 [rows, cols]."""
        if self.bits == 8:
            return self.q[panels, :, lanes].to(torch.int32)
        if self.packed:
            return packed_bits.panel_integers(self.q[panels], self.bits, lanes)
        byte = self.q[panels, :, lanes % 8].to(torch.int32)
        return (byte >> (4 * (lanes // 8)).unsqueeze(1)) & 0x0F

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense rows `ids` (an embedding lookup): [*ids.shape, cols]."""
        flat = ids.reshape(-1)
        panels, lanes = flat // PANEL, flat % PANEL
        groups = self.cols // self.group

        def of_rows(t):
            return _apply(lambda v: v[panels, :, lanes], t)

        scale = self._expand(of_rows(self.scale), of_rows(self.scale_sub), groups)
        ints = self._integers(panels, lanes) - self.zero
        w = ints.to(torch.float32) * scale.repeat_interleave(self.group, dim=1)
        offset = self._expand(of_rows(self.offset), of_rows(self.offset_sub), groups)
        if offset is not None:
            w += offset.repeat_interleave(self.group, dim=1)
        return w.to(dtype).view(*ids.shape, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_of(torch.arange(self.rows), dtype)


def cpu_panels(weight: QuantizedWeight | CpuPanels) -> CpuPanels:
    return weight if isinstance(weight, CpuPanels) else CpuPanels.from_weight(weight)


# --- int8 activations (`--quantized-activations int8`) -------------------------------------------
# Activations are quantized per row and per block of ACT_BLOCK columns (the weight's group where
# that is smaller: Q6_K's 16) to int8 with a float scale, as llama.cpp's Q8_0, and multiplied
# with integer dot products (csrc/quantized_matmul_int8act.c).
ACT_BLOCK = 32


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 -> (int8 [rows, cols], scale float32 [rows, cols / block]) with
    x ~ q * scale per block: scale = amax / 127, q = round(x / scale) (half to even), the C
    kernel's own arithmetic, so its integers are these."""
    rows, cols = x.shape
    blocks = x.float().reshape(rows, cols // block, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse).to(torch.int8)
    return q.reshape(rows, cols), d.squeeze(-1)


@dataclass
class Int8Panels(_HeldIntegers):
    """A QuantizedWeight in the int8-activation kernel's layout (csrc/quantized_matmul_int8act.c):
    unsigned integers u (a source's zero, or 8-bit's sign, shifted out and folded into the
    offset), w = scale * u + offset per group, rows in panels of 16 and columns in runs whose
    16 rows hold one 32-bit lane each -- q uint8 [panels, cols * 16 * layout_bits / 8]: 4-bit
    sources as nibbles (8 columns a run), every other width a byte a weight (4 a run); scale and
    offset float32 [panels, cols / group, 16]."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor
    group: int
    rows: int
    cols: int
    source: str = ""
    scale_sub = None
    offset_sub = None
    kernel: Callable | None = field(default=None, init=False, repr=False, compare=False)   # as CpuPanels'

    @property
    def layout_bits(self) -> int:
        return 4 if self.bits == 4 else 8

    @property
    def act_block(self) -> int:
        """Columns per activation scale: ACT_BLOCK, or the weight's group where smaller."""
        return min(ACT_BLOCK, self.group)

    @classmethod
    def applies_to(cls, weight: QuantizedWeight | CpuPanels) -> bool:
        """Whether the layout holds this weight: groups a multiple of the activation block."""
        return weight.group % min(ACT_BLOCK, weight.group) == 0 and min(ACT_BLOCK, weight.group) % 8 == 0

    @classmethod
    def from_weight(cls, weight: QuantizedWeight | CpuPanels) -> Int8Panels:
        panels, cols = -(-weight.rows // PANEL), weight.cols
        layout_bits = 4 if weight.bits == 4 else 8
        q = torch.empty(panels, cols * PANEL * layout_bits // 8, dtype=torch.uint8)
        groups = cols // weight.group
        scale = torch.zeros(panels, groups, PANEL)
        offset = torch.zeros(panels, groups, PANEL)
        # u = q + 128 for 8 bits (signed), q otherwise; w = s * (u - shift) + o = s * u + (o - shift * s)
        shift = 128 if weight.bits == 8 else weight.zero
        for start in range(0, weight.rows, PACK_SLICE_ROWS):
            count_rows = min(PACK_SLICE_ROWS, weight.rows - start)
            ints, s, o = _slice_values(weight, start, count_rows)
            p0, count = start // PANEL, -(-count_rows // PANEL)
            pad = count * PANEL - count_rows
            if weight.bits == 8:
                ints += 128
            ints = torch.nn.functional.pad(ints, (0, 0, 0, pad)).view(count, PANEL, cols)
            if layout_bits == 4:   # [panel, run, row, 4]: column 8c + i low, 8c + 4 + i high
                runs = ints.view(count, PANEL, cols // 8, 2, 4)
                packed = runs[:, :, :, 0] | (runs[:, :, :, 1] << 4)
            else:
                packed = ints.view(count, PANEL, cols // 4, 4)
            q[p0:p0 + count] = packed.transpose(1, 2).reshape(count, -1).to(torch.uint8)
            o = torch.zeros_like(s) if o is None else o
            if shift:
                o = o - float(shift) * s
            for mine, theirs in ((scale, s), (offset, o)):
                padded = torch.nn.functional.pad(theirs, (0, 0, 0, pad))
                mine[p0:p0 + count] = padded.view(count, PANEL, groups).transpose(1, 2)
        return cls(weight.bits, q, scale, offset, weight.group, weight.rows, cols, weight.source)

    def unsigned(self, ids: torch.Tensor) -> torch.Tensor:
        """The held integers u of rows `ids` -> int32 [n, cols]."""
        panels, lanes = ids // PANEL, ids % PANEL
        if self.layout_bits == 4:
            runs = self.q.view(-1, self.cols // 8, PANEL, 4)[panels, :, lanes].to(torch.int32)
            return torch.cat([runs & 0x0F, runs >> 4], dim=-1).reshape(ids.numel(), self.cols)
        return self.q.view(-1, self.cols // 4, PANEL, 4)[panels, :, lanes].to(torch.int32).reshape(ids.numel(), self.cols)

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense rows `ids` (an embedding lookup): [*ids.shape, cols]."""
        flat = ids.reshape(-1)
        panels, lanes = flat // PANEL, flat % PANEL
        u = self.unsigned(flat).view(flat.numel(), -1, self.group).to(torch.float32)
        w = u * self.scale[panels, :, lanes].unsqueeze(-1) + self.offset[panels, :, lanes].unsqueeze(-1)
        return w.view(flat.numel(), self.cols).to(dtype).view(*ids.shape, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_of(torch.arange(self.rows), dtype)


def _slice_values(weight: QuantizedWeight | CpuPanels, start: int, count: int):
    """Rows start..start+count of either layout: (integers int32 [count, cols] with the zero not
    subtracted, group scales float32 [count, groups], group offsets or None)."""
    if isinstance(weight, QuantizedWeight):
        part = weight.narrow_rows(start, count)
        return part.integers(), part.group_scales(), part.group_offsets()
    ids = torch.arange(start, start + count)
    panels, lanes = ids // PANEL, ids % PANEL
    groups = weight.cols // weight.group

    def of_rows(t):
        return _apply(lambda v: v[panels, :, lanes], t)

    return (weight._integers(panels, lanes), weight._expand(of_rows(weight.scale), of_rows(weight.scale_sub), groups),
            weight._expand(of_rows(weight.offset), of_rows(weight.offset_sub), groups))


def int8_activation_reference(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the int8-activation kernel computes, in torch: x quantized per row and block (the
    kernel's integers and scales), dequantized, times the dequantized weight."""
    rows = x.reshape(-1, weight.cols).float()
    q, d = quantize_activations(rows, min(ACT_BLOCK, weight.group))
    xq = (q.float().view(rows.shape[0], -1, min(ACT_BLOCK, weight.group)) * d.unsqueeze(-1)).view_as(rows)
    out = torch.nn.functional.linear(xq, weight.dequantize(torch.float32), None if bias is None else bias.float())
    return out.view(*x.shape[:-1], weight.rows).to(x.dtype)


def with_int8_activations(model: torch.nn.Module) -> int:
    """Every CPU quantized weight a module of `model` holds (`module.quantized`, a CpuPanels)
    repacked for the int8-activation kernel; returns how many were. Weights whose groups the
    kernel does not take keep the float32 path."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "quantized", None)
        if isinstance(weight, CpuPanels) and Int8Panels.applies_to(weight):
            module.quantized = Int8Panels.from_weight(weight)
            count += 1
    return count

# --- end of the int8-activation block -------------------------------------------------------------


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight | CpuPanels | Int8Panels,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols] @ w.T (+ bias) -> [..., rows] in x's dtype, on the weight's device: the C
    kernel on the CPU (a QuantizedWeight is repacked into panels first: the engine does it once
    at load; an Int8Panels weight takes the int8-activation kernel), Triton on CUDA,
    dequantize-then-multiply where neither applies."""
    if x.is_cpu or isinstance(weight, Int8Panels):
        panels = weight if isinstance(weight, (CpuPanels, Int8Panels)) else CpuPanels.from_weight(weight)
        # A step's float32 rows [T, cols] go as they are (a decode step: no copy, no view).
        plain = x.dtype == torch.float32 and len(x.shape) == 2
        rows = x if plain else x.reshape(-1, weight.cols).float()
        out = cpu_native.quantized_matmul(rows if rows.stride(1) == 1 else rows.contiguous(), panels,
                                          None if bias is None else bias.float())
        if out is not None:
            return out if plain else out.view(*x.shape[:-1], weight.rows).to(x.dtype)
    elif x.device.type == "cuda" and isinstance(weight, QuantizedWeight):
        from rein.kernels import use_triton

        # The Triton kernel's K-tiles take groups of 16 columns or more (the 8-bit form allows 8).
        if use_triton(x) and weight.group % 16 == 0:
            from rein.kernels import triton_quantized

            return triton_quantized.quantized_linear(x, weight, bias)
    return reference_linear(x, weight, bias)
