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
* bits 8: q is int8 [N, K], -128..127 (5- and 6-bit GGUF types are stored here: a byte per
  weight rather than GGUF's bit planes, which costs memory but keeps one simple kernel).

scale and offset are float32 [N, K / group]: GGUF's k-quants scale a sub-block by the product
of two fp16/6-bit numbers, which float16 cannot hold exactly, and float32 keeps every source
format bit-exact (a repacked weight dequantizes to exactly what gguf's own dequantize gives).
The price is 64 bits per group: 2 bits a weight at group 32.

That row-major form is what checkpoints are repacked into, sharded, stacked and what Triton
reads on CUDA. On the CPU the engine repacks each weight once more, at load, into `CpuPanels`
(the same integers and scales, rows in panels of 16 with each column's 16 side by side), the
layout rein's C kernel multiplies with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.offset) if t is not None)


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

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weight: {self.bits} bits (rein keeps 4 or 8)")
        if self.cols % self.group:
            raise ValueError(f"quantized weight: {self.cols} columns are not whole groups of {self.group}")
        if self.bits == 4 and (self.group % NIBBLE_RUN or self.cols % NIBBLE_RUN):
            raise ValueError(f"4-bit weight: group {self.group} and columns {self.cols} must be "
                             f"multiples of {NIBBLE_RUN}")
        want_q = (self.rows, self.cols // 2) if self.bits == 4 else (self.rows, self.cols)
        want_s = (self.rows, self.cols // self.group)
        if tuple(self.q.shape) != want_q or tuple(self.scale.shape) != want_s or (
                self.offset is not None and tuple(self.offset.shape) != want_s):
            raise ValueError(f"quantized weight [{self.rows}, {self.cols}] group {self.group}: q "
                             f"{tuple(self.q.shape)} (want {want_q}), scale {tuple(self.scale.shape)} (want {want_s})")

    def integers(self) -> torch.Tensor:
        """q as one int32 [rows, cols] (4-bit runs unpacked)."""
        if self.bits == 8:
            return self.q.to(torch.int32)
        runs = self.q.view(self.rows, self.cols // NIBBLE_RUN, NIBBLE_RUN // 2).to(torch.int32)
        return torch.cat([runs & 0x0F, runs >> 4], dim=2).view(self.rows, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [rows, cols] weight."""
        groups = self.integers().view(self.rows, -1, self.group).to(torch.float32)
        w = groups * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w += self.offset.unsqueeze(-1)
        return w.view(self.rows, self.cols).to(dtype)

    def map_rows(self, fn, rows: int | None = None) -> QuantizedWeight:
        """The weight with `fn` applied to q, scale and offset alike (an operation on rows)."""
        return QuantizedWeight(self.bits, fn(self.q), fn(self.scale), _apply(fn, self.offset), self.group,
                               self.rows if rows is None else rows, self.cols, self.source)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return self.map_rows(lambda t: t.to(device))

    def narrow_rows(self, start: int, length: int) -> QuantizedWeight:
        """Rows start..start+length (a tensor-parallel shard of the output dimension)."""
        return self.map_rows(lambda t: t[start:start + length].contiguous(), length)

    def narrow_cols(self, start: int, length: int) -> QuantizedWeight | None:
        """Columns start..start+length (a shard of the input dimension); None where the cut
        is not on group (and 4-bit run) boundaries."""
        unit = self.group
        if start % unit or length % unit:
            return None
        per_byte = 2 if self.bits == 4 else 1
        q = self.q[:, start // per_byte:(start + length) // per_byte].contiguous()
        groups = slice(start // unit, (start + length) // unit)
        return QuantizedWeight(self.bits, q, self.scale[:, groups].contiguous(),
                               None if self.offset is None else self.offset[:, groups].contiguous(),
                               self.group, self.rows, length, self.source)

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


def widened(weight: QuantizedWeight, group: int) -> QuantizedWeight:
    """The same weight as 8-bit integers in groups of `group` (a divisor of its group), scales
    repeated: how weights of different formats are stacked into one fused matrix. The 8-bit
    form holds any 4-bit weight exactly (q 0..15 fits int8)."""
    if weight.group % group:
        raise ValueError(f"cannot regroup a group of {weight.group} into groups of {group}")
    repeat = weight.group // group
    q = weight.integers().to(torch.int8) if weight.bits == 4 else weight.q

    def spread(t):
        return _apply(lambda s: s.repeat_interleave(repeat, dim=1).contiguous(), t)

    return QuantizedWeight(8, q.contiguous(), spread(weight.scale), spread(weight.offset), group, weight.rows, weight.cols,
                           weight.source)


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights with the same columns stacked on the row dimension (fused q/k/v, gate/up).
    Parts of one format stack as they are; mixed formats are widened to 8 bits and the
    smallest group first (what a GGUF "_M" file's mixed layers need)."""
    first = parts[0]
    if any(p.cols != first.cols for p in parts):
        raise ValueError("stacked weights must have the same number of columns")
    if any(p.bits != first.bits or p.group != first.group or (p.offset is None) != (first.offset is None)
           for p in parts):
        group = min(p.group for p in parts)
        parts = [widened(p, group) for p in parts]
        if any(p.offset is None for p in parts) and any(p.offset is not None for p in parts):
            parts = [p if p.offset is not None else _with_zero_offset(p) for p in parts]
        first = parts[0]
    offsets = [p.offset for p in parts]
    sources = ",".join(sorted({p.source for p in parts if p.source}))
    return QuantizedWeight(first.bits, torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           None if offsets[0] is None else torch.cat(offsets), first.group, sum(p.rows for p in parts), first.cols,
                           sources)


def _with_zero_offset(weight: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(weight.bits, weight.q, weight.scale, torch.zeros_like(weight.scale), weight.group,
                           weight.rows, weight.cols, weight.source)


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
    scale and offset [panels, cols / group, 16] float32; the last panel's missing rows zero."""

    bits: int
    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    rows: int
    cols: int
    source: str = ""

    @classmethod
    def from_weight(cls, weight: QuantizedWeight) -> CpuPanels:
        panels = -(-weight.rows // PANEL)
        width = PANEL if weight.bits == 8 else PANEL // 2
        q = torch.empty(panels, weight.cols, width, dtype=torch.int8 if weight.bits == 8 else torch.uint8)
        groups = weight.cols // weight.group
        scale = torch.zeros(panels, groups, PANEL)
        offset = None if weight.offset is None else torch.zeros(panels, groups, PANEL)
        for start in range(0, weight.rows, PACK_SLICE_ROWS):
            part = weight.narrow_rows(start, min(PACK_SLICE_ROWS, weight.rows - start))
            p0, count = start // PANEL, -(-part.rows // PANEL)
            pad = count * PANEL - part.rows
            ints = torch.nn.functional.pad(part.integers(), (0, 0, 0, pad)).view(count, PANEL, -1).transpose(1, 2)
            if weight.bits == 8:
                q[p0:p0 + count] = ints.to(torch.int8)
            else:
                q[p0:p0 + count] = (ints[..., :8] | (ints[..., 8:] << 4)).to(torch.uint8)
            for mine, theirs in ((scale, part.scale), (offset, part.offset)):
                if mine is not None:
                    padded = torch.nn.functional.pad(theirs, (0, 0, 0, pad))
                    mine[p0:p0 + count] = padded.view(count, PANEL, groups).transpose(1, 2)
        return cls(weight.bits, q, scale, offset, weight.group, weight.rows, weight.cols, weight.source)

    def _integers(self, panels: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
        """The integers of rows (panel, lane) -> int32 [rows, cols]."""
        if self.bits == 8:
            return self.q[panels, :, lanes].to(torch.int32)
        byte = self.q[panels, :, lanes % 8].to(torch.int32)
        return (byte >> (4 * (lanes // 8)).unsqueeze(1)) & 0x0F

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense rows `ids` (an embedding lookup): [*ids.shape, cols]."""
        flat = ids.reshape(-1)
        panels, lanes = flat // PANEL, flat % PANEL
        groups = self.scale[panels, :, lanes].repeat_interleave(self.group, dim=1)
        w = self._integers(panels, lanes).to(torch.float32) * groups
        if self.offset is not None:
            w += self.offset[panels, :, lanes].repeat_interleave(self.group, dim=1)
        return w.to(dtype).view(*ids.shape, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.rows_of(torch.arange(self.rows), dtype)


def cpu_panels(weight: QuantizedWeight | CpuPanels) -> CpuPanels:
    return weight if isinstance(weight, CpuPanels) else CpuPanels.from_weight(weight)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight | CpuPanels,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., cols] @ w.T (+ bias) -> [..., rows] in x's dtype, on the weight's device: the C
    kernel on the CPU (a QuantizedWeight is repacked into panels first: the engine does it once
    at load), Triton on CUDA, dequantize-then-multiply where neither applies."""
    if x.device.type == "cuda" and isinstance(weight, QuantizedWeight):
        from rein.kernels import use_triton

        # The Triton kernel's K-tiles take groups of 16 columns or more (the 8-bit form allows 8).
        if use_triton(x) and weight.group % 16 == 0:
            from rein.kernels import triton_quantized

            return triton_quantized.quantized_linear(x, weight, bias)
    elif x.device.type == "cpu":
        from rein.kernels import cpu_native

        rows = x.reshape(-1, weight.cols).float()
        out = cpu_native.quantized_matmul(rows if rows.stride(1) == 1 else rows.contiguous(), cpu_panels(weight),
                                          None if bias is None else bias.float())
        if out is not None:
            return out.view(*x.shape[:-1], weight.rows).to(x.dtype)
    return reference_linear(x, weight, bias)
