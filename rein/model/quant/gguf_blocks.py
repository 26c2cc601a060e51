"""GGUF's quantized blocks repacked into rein's `QuantizedWeight`, bit for bit.

A GGUF matrix is stored row by row, each row a run of blocks along the input dimension
(llama.cpp's ggml-quants.c defines them; the gguf package's numpy dequantizers read them the
same way, and the tests check against those). Every supported type is an affine map of small
integers per group of columns, so it repacks without loss:

    type   block  integers         per group                         rein form
    Q4_0    32    4-bit, q - 8     d (fp16)                          4-bit, scale d, offset -8d
    Q4_1    32    4-bit            d, m (fp16)                       4-bit, scale d, offset m
    Q5_0    32    5-bit, q - 16    d                                 5-bit, zero 16, scale d (fp16)
    Q5_1    32    5-bit            d, m                              5-bit, scale d, offset m (fp16)
    Q8_0    32    int8             d                                 8-bit, scale d
    Q4_K   256    4-bit            d*sc, dmin*m per 32 (6-bit sc, m) 4-bit, group 32
    Q5_K   256    5-bit            d*sc, dmin*m per 32               5-bit, group 32, block 256:
                                                                     scale d x sc, offset -dmin x m
    Q6_K   256    6-bit, q - 32    d*sc per 16 (int8 sc)             6-bit, zero 32, group 16,
                                                                     block 256: scale d x sc

Other types (Q2_K, Q3_K, the IQ types, ...) return None: the loader dequantizes them and says so.
The 5- and 6-bit types stay packed (rein.kernels.packed_bits: a nibble plane and 1-bit planes)
with GGUF's own two-level scales, float16 per block times int8 per group, so they are held at
their file's size: `held_bytes` gives what each type costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from rein.kernels.packed_bits import pack_rows
from rein.kernels.quantized import NIBBLE_RUN, QuantizedWeight

QK_K = 256

# Bytes rein holds per GGUF block of each type it keeps quantized, its scales included (4- and
# 8-bit forms: float32 scale and offset per group of 32 -- 16 for Q6_K's 8-bit form; 5/6-bit
# forms: the file's own fields). `held_bytes` and `rein estimate` count with it.
HELD_BYTES = {  # type -> (columns per block, bytes held per block)
    "Q4_0": (32, 16 + 8), "Q4_1": (32, 16 + 8), "Q8_0": (32, 32 + 4), "Q4_K": (256, 128 + 8 * 8),
    "Q5_0": (32, 20 + 2), "Q5_1": (32, 20 + 4), "Q5_K": (256, 160 + 4 + 16), "Q6_K": (256, 192 + 2 + 16),
}


def held_bytes(type_name: str, rows: int, cols: int) -> int | None:
    """Bytes a [rows, cols] matrix of that type holds once repacked; None for a type rein does
    not keep quantized."""
    form = HELD_BYTES.get(type_name)
    if form is None:
        return None
    block, size = form
    return rows * (cols // block) * size


def supported_types() -> dict[int, str]:
    """GGML type id -> name, for the types `repack` keeps quantized."""
    from gguf import GGMLQuantizationType as T

    return {int(t): t.name for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)}


def repack(raw: np.ndarray, type_name: str, rows: int, cols: int) -> QuantizedWeight | None:
    """The [rows, cols] matrix whose GGUF bytes are `raw` (uint8, rows x bytes-per-row) as a
    QuantizedWeight; None for a type rein does not keep quantized."""
    unpack = _UNPACKERS.get(type_name)
    if unpack is None:
        return None
    blocks = np.ascontiguousarray(raw).reshape(rows, -1)
    form = unpack(blocks, rows, cols)
    if isinstance(form, QuantizedWeight):
        form.source = type_name
        return form
    bits, q, scale, offset, group = form
    return QuantizedWeight(bits, _tensor(q), _tensor(scale.astype(np.float32)),
                           None if offset is None else _tensor(offset.astype(np.float32)), group, rows, cols, type_name)


# The file bytes `repack_rows` reads at a time: a large matrix (an embedding of a 262k-token
# vocabulary is 178 MiB of Q8_0) is never held twice, once as the file's blocks and once repacked.
CHUNK_BYTES = 16 << 20

# The fields of a QuantizedWeight that hold one entry (or run) per row, in the first dimension.
ROW_FIELDS = ("q", "scale", "offset", "scale_sub", "offset_sub")


def repack_rows(read_rows: Callable[[int, int], np.ndarray], type_name: str, rows: int, cols: int,
                row_bytes: int, chunk_bytes: int | None = None) -> QuantizedWeight | None:
    """`repack` of a [rows, cols] matrix read a few rows at a time: `read_rows(start, stop)`
    gives rows start..stop of the file's bytes (uint8 [stop - start, row_bytes]), and each
    chunk's repacked rows are copied into tensors made once for the whole matrix. The load's
    extra memory is one chunk, not the matrix's file bytes. None for a type rein does not keep
    quantized (nothing is read)."""
    if type_name not in _UNPACKERS:
        return None
    step = max(1, (chunk_bytes or CHUNK_BYTES) // row_bytes)
    first = repack(read_rows(0, min(step, rows)), type_name, min(step, rows), cols)
    if first.rows == rows:
        return first
    whole = {name: torch.empty((rows, *part.shape[1:]), dtype=part.dtype)
             for name in ROW_FIELDS if (part := getattr(first, name)) is not None}
    for name, tensor in whole.items():
        tensor[:first.rows] = getattr(first, name)
    for start in range(first.rows, rows, step):
        stop = min(rows, start + step)
        chunk = repack(read_rows(start, stop), type_name, stop - start, cols)
        for name, tensor in whole.items():
            tensor[start:stop] = getattr(chunk, name)
    return dataclasses.replace(first, rows=rows, **whole)


def _packed(bits: int, q: np.ndarray, group: int, scale: np.ndarray, *, zero: int = 0, offset=None,
            block: int = 0, scale_sub=None, offset_sub=None) -> QuantizedWeight:
    """Unsigned 5/6-bit integers [rows, cols] and GGUF's float16 / int8 scale fields as rein's
    packed form."""
    rows, cols = q.shape
    return QuantizedWeight(bits, pack_rows(_tensor(q), bits), _tensor(scale), _apply_tensor(offset), group, rows, cols,
                           zero=zero, block=block, scale_sub=_apply_tensor(scale_sub),
                           offset_sub=_apply_tensor(offset_sub))


def _apply_tensor(array: np.ndarray | None) -> torch.Tensor | None:
    return None if array is None else _tensor(array)


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array))


def _split(blocks: np.ndarray, rows: int, block_bytes: int, *sizes: int) -> list[np.ndarray]:
    """Each block's fields [rows, blocks per row, size] (the last one takes the rest)."""
    b = blocks.reshape(rows, -1, block_bytes)
    out, at = [], 0
    for size in sizes:
        out.append(b[:, :, at:at + size])
        at += size
    out.append(b[:, :, at:])
    return out


def _f16(field: np.ndarray) -> np.ndarray:
    """A 2-byte field as float32 [rows, blocks]."""
    return _half(field).astype(np.float32)


def _half(field: np.ndarray) -> np.ndarray:
    """A 2-byte field as float16 [rows, blocks]."""
    return np.ascontiguousarray(field).view(np.float16)[..., 0]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Integers 0..15 [rows, cols] -> uint8 [rows, cols / 2], rein's run-of-32 layout."""
    rows = q.shape[0]
    runs = q.reshape(rows, -1, 2, NIBBLE_RUN // 2).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(rows, -1)


def _q4_0(blocks, rows, cols):
    d, qs = _split(blocks, rows, 18, 2)
    d = _f16(d)
    # GGUF's 32-blocks already hold column j low, j + 16 high: the bytes are rein's layout.
    return 4, qs.reshape(rows, cols // 2), d, -8.0 * d, 32


def _q4_1(blocks, rows, cols):
    d, m, qs = _split(blocks, rows, 20, 2, 2)
    return 4, qs.reshape(rows, cols // 2), _f16(d), _f16(m), 32


def _five_bit(qh: np.ndarray, qs: np.ndarray, rows: int) -> np.ndarray:
    """Q5_0 / Q5_1 integers 0..31 [rows, cols] from their high-bit words and nibbles."""
    high = np.ascontiguousarray(qh).view(np.uint32)          # [rows, nb, 1]
    high = (high >> np.arange(32, dtype=np.uint32)) & 1       # [rows, nb, 32]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)       # [rows, nb, 32]
    return (low | (high.astype(np.uint8) << 4)).reshape(rows, -1)


def _q5_0(blocks, rows, cols):
    d, qh, qs = _split(blocks, rows, 22, 2, 4)
    return _packed(5, _five_bit(qh, qs, rows), 32, _half(d), zero=16)


def _q5_1(blocks, rows, cols):
    d, m, qh, qs = _split(blocks, rows, 24, 2, 2, 4)
    return _packed(5, _five_bit(qh, qs, rows), 32, _half(d), offset=_half(m))


def _q8_0(blocks, rows, cols):
    d, qs = _split(blocks, rows, 34, 2)
    return 8, np.ascontiguousarray(qs).view(np.int8).reshape(rows, cols), _f16(d), None, 32


def _k_factors(scales: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins, uint8 [rows, blocks, 8] each."""
    s = scales.reshape(rows, -1, 3, 4)
    lo, mid, hi = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scales(scales: np.ndarray, d: np.ndarray, dmin: np.ndarray, rows: int):
    """Q4_K: the sub-blocks' scale and offset as float32 [rows, cols / 32]."""
    sc, mn = _k_factors(scales, rows)
    return ((d[..., None] * sc.astype(np.float32)).reshape(rows, -1),
            -(dmin[..., None] * mn.astype(np.float32)).reshape(rows, -1))


def _q4_k(blocks, rows, cols):
    d, dmin, scales, qs = _split(blocks, rows, 144, 2, 2, 12)
    scale, offset = _k_scales(scales, _f16(d), _f16(dmin), rows)
    # Each 64 columns: 32 bytes, column c low nibble, column c + 32 high nibble.
    q = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return 4, _pack_nibbles((q & 0x0F).reshape(rows, cols)), scale, offset, 32


def _q5_k(blocks, rows, cols):
    d, dmin, scales, qh, qs = _split(blocks, rows, 176, 2, 2, 12, 32)
    sc, mn = _k_factors(scales, rows)
    low = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(rows, -1, 8, 32)
    # Sub-block i's fifth bits are bit i of the 32 shared high bytes.
    high = (qh.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    q = (low | (high << 4)).reshape(rows, cols)
    # -dmin x m is -(dmin x m) exactly: the offset keeps the file's factors, negated.
    return _packed(5, q, 32, _half(d), block=QK_K, scale_sub=sc.astype(np.int8).reshape(rows, -1),
                   offset=-_half(dmin), offset_sub=mn.astype(np.int8).reshape(rows, -1))


def _q6_k(blocks, rows, cols):
    ql, qh, sc, d = _split(blocks, rows, 210, QK_K // 2, QK_K // 4, QK_K // 16)
    # Two halves of 128 columns: 64 low-nibble bytes (columns 0-31 and 32-63 low, 64-127 high)
    # and 32 bytes of 2-bit pairs (columns c, c + 32, c + 64, c + 96).
    low = ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(rows, -1, 2, 4, 32)
    high = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 0x03).reshape(rows, -1, 2, 4, 32)
    q = (low | (high << 4)).reshape(rows, cols)
    return _packed(6, q, 16, _half(d), zero=32, block=QK_K,
                   scale_sub=np.ascontiguousarray(sc).view(np.int8).reshape(rows, -1))


_UNPACKERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
              "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
