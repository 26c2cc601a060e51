"""GGUF's quantized blocks repacked into rein's `QuantizedWeight`, bit for bit.

A GGUF matrix is stored row by row, each row a run of blocks along the input dimension
(llama.cpp's ggml-quants.c defines them; the gguf package's numpy dequantizers read them the
same way, and the tests check against those). Every supported type is an affine map of small
integers per group of columns, so it repacks without loss:

    type   block  integers         per group                         rein form
    Q4_0    32    4-bit, q - 8     d (fp16)                          4-bit, scale d, offset -8d
    Q4_1    32    4-bit            d, m (fp16)                       4-bit, scale d, offset m
    Q5_0    32    5-bit, q - 16    d                                 8-bit, scale d
    Q5_1    32    5-bit            d, m                              8-bit, scale d, offset m
    Q8_0    32    int8             d                                 8-bit, scale d
    Q4_K   256    4-bit            d*sc, dmin*m per 32 (6-bit sc, m) 4-bit, group 32
    Q5_K   256    5-bit            d*sc, dmin*m per 32               8-bit, group 32
    Q6_K   256    6-bit, q - 32    d*sc per 16 (int8 sc)             8-bit, group 16

Other types (Q2_K, Q3_K, the IQ types, ...) return None: the loader dequantizes them and says so.
5- and 6-bit integers are held one per byte, not in GGUF's bit planes (one kernel for all of
them; about 1.6x the file's bytes for those tensors).
"""

from __future__ import annotations

import numpy as np
import torch

from rein.kernels.quantized import NIBBLE_RUN, QuantizedWeight

QK_K = 256


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
    bits, q, scale, offset, group = unpack(blocks, rows, cols)
    return QuantizedWeight(bits, _tensor(q), _tensor(scale.astype(np.float32)),
                           None if offset is None else _tensor(offset.astype(np.float32)), group, rows, cols, type_name)


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
    return np.ascontiguousarray(field).view(np.float16)[..., 0].astype(np.float32)


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
    q = _five_bit(qh, qs, rows).astype(np.int8) - np.int8(16)
    return 8, q, _f16(d), None, 32


def _q5_1(blocks, rows, cols):
    d, m, qh, qs = _split(blocks, rows, 24, 2, 2, 4)
    return 8, _five_bit(qh, qs, rows).astype(np.int8), _f16(d), _f16(m), 32


def _q8_0(blocks, rows, cols):
    d, qs = _split(blocks, rows, 34, 2)
    return 8, np.ascontiguousarray(qs).view(np.int8).reshape(rows, cols), _f16(d), None, 32


def _k_scales(scales: np.ndarray, d: np.ndarray, dmin: np.ndarray, rows: int):
    """Q4_K / Q5_K: the 8 sub-blocks' 6-bit scales and mins -> float32 scale, offset [rows, cols / 32]."""
    s = scales.reshape(rows, -1, 3, 4)
    lo, mid, hi = s[:, :, 0], s[:, :, 1], s[:, :, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1).astype(np.float32)
    return (d[..., None] * sc).reshape(rows, -1), -(dmin[..., None] * mn).reshape(rows, -1)


def _q4_k(blocks, rows, cols):
    d, dmin, scales, qs = _split(blocks, rows, 144, 2, 2, 12)
    scale, offset = _k_scales(scales, _f16(d), _f16(dmin), rows)
    # Each 64 columns: 32 bytes, column c low nibble, column c + 32 high nibble.
    q = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    return 4, _pack_nibbles((q & 0x0F).reshape(rows, cols)), scale, offset, 32


def _q5_k(blocks, rows, cols):
    d, dmin, scales, qh, qs = _split(blocks, rows, 176, 2, 2, 12, 32)
    scale, offset = _k_scales(scales, _f16(d), _f16(dmin), rows)
    low = qs.reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(rows, -1, 8, 32)
    # Sub-block i's fifth bits are bit i of the 32 shared high bytes.
    high = (qh.reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
    return 8, (low | (high << 4)).astype(np.int8).reshape(rows, cols), scale, offset, 32


def _q6_k(blocks, rows, cols):
    ql, qh, sc, d = _split(blocks, rows, 210, QK_K // 2, QK_K // 4, QK_K // 16)
    scale = (_f16(d)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)).reshape(rows, -1)
    # Two halves of 128 columns: 64 low-nibble bytes (columns 0-31 and 32-63 low, 64-127 high)
    # and 32 bytes of 2-bit pairs (columns c, c + 32, c + 64, c + 96).
    low = ql.reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    low = (low & 0x0F).reshape(rows, -1, 2, 4, 32)
    high = qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = (high & 0x03).reshape(rows, -1, 2, 4, 32)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return 8, q.reshape(rows, cols), scale, None, 16


_UNPACKERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
              "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
