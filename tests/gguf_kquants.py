"""Float matrices written as GGUF Q5_K / Q6_K blocks, byte for byte in llama.cpp's layout, for
tests (the gguf package quantizes Q4_0 ... Q8_0 but not the k-quants). A plain round-to-nearest
quantizer, not llama.cpp's search: tests need valid blocks near the weight, and check them with
gguf's own `dequantize`. Imported by the tests as a plain module.
"""

from __future__ import annotations

import numpy as np

QK_K = 256


def _d(values: np.ndarray, top: int) -> np.ndarray:
    """A float16 super-block scale so that values / d rounds into 0..top."""
    d = (values.max(axis=-1) / top).astype(np.float16)
    return np.where(d == 0, np.float16(1e-7), d)


def q6_k(w: np.ndarray) -> np.ndarray:
    """w float [rows, cols] (cols a multiple of 256) -> Q6_K bytes uint8 [rows, cols / 256 * 210]."""
    rows, cols = w.shape
    b = w.astype(np.float32).reshape(rows, -1, 16, 16)                 # [rows, blocks, 16 groups, 16]
    group = np.abs(b).max(axis=-1) / 31                                 # each group's ideal scale
    d = _d(group, 127)                                                  # [rows, blocks]
    sc = np.clip(np.round(group / d[..., None].astype(np.float32)), -128, 127).astype(np.int8)
    eff = d[..., None].astype(np.float32) * sc.astype(np.float32)
    safe = np.where(eff == 0, 1, eff)
    q = np.clip(np.round(b / safe[..., None]), -32, 31).astype(np.int32) + 32
    q = np.where(eff[..., None] == 0, 32, q).reshape(rows, -1, 2, 4, 32)   # [.., half, quarter, 32]
    low, high = q & 0x0F, q >> 4
    ql = np.zeros((rows, q.shape[1], 2, 64), np.uint8)
    qh = np.zeros((rows, q.shape[1], 2, 32), np.uint8)
    for j in range(4):   # quarter j: ql bytes (j % 2) * 32 + l, nibble j // 2; qh bits 2j
        ql[..., (j % 2) * 32:(j % 2) * 32 + 32] |= (low[:, :, :, j] << (4 * (j // 2))).astype(np.uint8)
        qh |= (high[:, :, :, j] << (2 * j)).astype(np.uint8)
    blocks = np.concatenate([ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8),
                             d[..., None].view(np.uint8).reshape(rows, -1, 2)], axis=-1)
    return blocks.reshape(rows, -1)


def q5_k(w: np.ndarray) -> np.ndarray:
    """w float [rows, cols] (cols a multiple of 256) -> Q5_K bytes uint8 [rows, cols / 256 * 176]."""
    rows, cols = w.shape
    b = w.astype(np.float32).reshape(rows, -1, 8, 32)                  # [rows, blocks, 8 sub-blocks, 32]
    low_value = np.minimum(b.min(axis=-1), 0)
    scale = (b.max(axis=-1) - low_value) / 31
    d, dmin = _d(scale, 63), _d(-low_value, 63)
    sc = np.clip(np.round(scale / d[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(-low_value / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    eff = d[..., None].astype(np.float32) * sc
    shift = dmin[..., None].astype(np.float32) * m
    safe = np.where(eff == 0, 1, eff)
    q = np.clip(np.round((b + shift[..., None]) / safe[..., None]), 0, 31).astype(np.uint8)
    q = np.where(eff[..., None] == 0, 0, q)                            # [rows, blocks, 8, 32]
    qs = np.zeros((rows, q.shape[1], 4, 32), np.uint8)
    qh = np.zeros((rows, q.shape[1], 32), np.uint8)
    for s in range(8):   # sub-block s: qs chunk s // 2, nibble s % 2; qh bit s
        qs[:, :, s // 2] |= (q[:, :, s] & 0x0F) << (4 * (s % 2))
        qh |= (q[:, :, s] >> 4) << s
    lo, hi = sc[..., :4], sc[..., 4:]
    mlo, mhi = m[..., :4], m[..., 4:]
    scales = np.concatenate([lo | ((hi >> 4) << 6), mlo | ((mhi >> 4) << 6), (hi & 0x0F) | ((mhi & 0x0F) << 4)],
                            axis=-1).astype(np.uint8)
    blocks = np.concatenate([d[..., None].view(np.uint8).reshape(rows, -1, 2),
                             dmin[..., None].view(np.uint8).reshape(rows, -1, 2), scales, qh, qs.reshape(rows, -1, 128)],
                            axis=-1)
    return blocks.reshape(rows, -1)


def quantize(w: np.ndarray, type_name: str) -> np.ndarray:
    """GGUF bytes of w in `type_name`: Q5_K / Q6_K here, the rest through gguf's quantizer."""
    if type_name == "Q5_K":
        return q5_k(w)
    if type_name == "Q6_K":
        return q6_k(w)
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(w.astype(np.float32), GGMLQuantizationType[type_name])
