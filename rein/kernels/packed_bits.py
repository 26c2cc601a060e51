"""5- and 6-bit integers held packed: a nibble plane and one or two 1-bit planes, as llama.cpp's
own Q5/Q6 blocks hold them, so a weight costs 5/8 or 6/8 of a byte rather than a whole one.

Two layouts of the same integers (unsigned, 0..31 or 0..63), one for each kernel family:

* rows (`QuantizedWeight`, what Triton reads): each row is runs of 32 columns, a run 4 x bits
  bytes -- 16 bytes of nibbles exactly as 4-bit weights hold them (byte j: column j low, column
  j + 16 high), then one 4-byte plane per bit above the fourth (bit b of the plane's byte i:
  that bit of column 8i + b). A 5-bit run is 20 bytes, a 6-bit run 24.
* panels (`CpuPanels`, what the C kernel reads): per 16-row panel, its nibbles as 4-bit panels
  hold them (8 bytes a column, byte j: row j low, row j + 8 high), then one plane per high bit,
  a little-endian uint16 a column (bit j: row j's) -- 2 x bits bytes a column in all. The C
  kernel turns four columns' nibbles into one vector of int8 and adds each plane's 64 bits
  under a byte mask (AVX-512BW; AVX2 and plain C expand 16 columns to int8 in L1), then goes on
  as for 8-bit columns (csrc/quantized_matmul_cpu.c).

Packing and unpacking here are torch, run once at load (and by the reference paths).
"""

from __future__ import annotations

import torch

PACKED_BITS = (5, 6)
RUN = 32   # columns per packed run in the row layout (a 4-bit run's width)


def run_bytes(bits: int) -> int:
    """Bytes of one run of 32 columns in the row layout."""
    return 4 * bits


def _planes(values: torch.Tensor, bit: int) -> torch.Tensor:
    """Bit `bit` of each of values [..., n] (n a multiple of 8) as bytes [..., n / 8], low bit first."""
    bits = ((values >> bit) & 1).view(*values.shape[:-1], -1, 8)
    weights = 1 << torch.arange(8, dtype=torch.int32, device=values.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _unplane(planes: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n / 8] -> bits [..., n] (int32 0/1), the inverse of `_planes`."""
    shifts = torch.arange(8, dtype=torch.int32, device=planes.device)
    bits = (planes.to(torch.int32).unsqueeze(-1) >> shifts) & 1
    return bits.view(*planes.shape[:-1], -1)


def pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers [rows, cols] (0..2^bits - 1; cols a multiple of 32) -> uint8 [rows, cols * bits / 8]."""
    rows, cols = q.shape
    runs = q.to(torch.int32).reshape(rows, cols // RUN, RUN)
    low = runs & 0x0F
    nibbles = (low[..., :16] | (low[..., 16:] << 4)).to(torch.uint8)
    planes = [_planes(runs, 4 + p) for p in range(bits - 4)]
    return torch.cat([nibbles, *planes], dim=2).reshape(rows, -1)


def unpack_rows(packed: torch.Tensor, bits: int, rows: int, cols: int) -> torch.Tensor:
    """uint8 [rows, cols * bits / 8] -> int32 [rows, cols], the inverse of `pack_rows`."""
    b = packed.reshape(rows, cols // RUN, run_bytes(bits)).to(torch.int32)
    q = torch.cat([b[..., :16] & 0x0F, b[..., :16] >> 4], dim=2)
    for p in range(bits - 4):
        q = q | (_unplane(b[..., 16 + 4 * p:20 + 4 * p]) << (4 + p))
    return q.reshape(rows, cols)


def pack_panels(ints: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers [panels, cols, 16] (a panel's rows side by side) -> uint8 [panels, cols * 2 * bits]:
    each panel's nibbles [cols][8], then its planes, uint16 [cols] each."""
    ints = ints.to(torch.int32)
    count, cols = ints.shape[:2]
    low = ints & 0x0F
    nibbles = (low[..., :8] | (low[..., 8:] << 4)).to(torch.uint8).reshape(count, cols * 8)
    planes = [_planes(ints, 4 + p).reshape(count, cols * 2) for p in range(bits - 4)]
    return torch.cat([nibbles, *planes], dim=1)


def panel_integers(panels: torch.Tensor, bits: int, lanes: torch.Tensor) -> torch.Tensor:
    """Row `lanes[i]` of panels [n, cols * 2 * bits] (the panel of row i) -> int32 [n, cols]."""
    n, cols = panels.shape[0], panels.shape[1] // (2 * bits)
    b = panels.to(torch.int32)
    lane = lanes.view(-1, 1)
    nibbles = b[:, :cols * 8].view(n, cols, 8)
    index = (lane % 8).unsqueeze(-1).expand(-1, cols, 1)
    q = (nibbles.gather(2, index).squeeze(2) >> (4 * (lane // 8))) & 0x0F
    for p in range(bits - 4):
        plane = b[:, cols * (8 + 2 * p):cols * (10 + 2 * p)].view(n, cols, 2)
        word = plane[..., 0] | (plane[..., 1] << 8)
        q = q | (((word >> lane) & 1) << (4 + p))
    return q
