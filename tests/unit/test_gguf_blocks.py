"""GGUF's quantized blocks repacked into rein's QuantizedWeight (rein.model.quant.gguf_blocks):
for every type rein keeps quantized, random blocks (every bit pattern is a valid block; the
fp16 scale fields set to finite values) dequantize through rein's form to exactly what the
gguf package's own dequantizer gives, and multiply like the dequantized matrix."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

from rein.kernels.quantized import quantized_linear
from rein.model.quant.gguf_blocks import repack, supported_types

# Byte offsets of each block's fp16 fields (ggml-quants.h's block structs).
FP16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
               "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        raw[:, :, at:at + 2] = rng.uniform(-0.05, 0.05, (rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_every_supported_type_is_tested():
    assert set(supported_types().values()) == set(FP16_FIELDS)


@pytest.mark.parametrize("name", sorted(FP16_FIELDS))
def test_repacked_blocks_dequantize_bit_for_bit(name):
    rows, cols = 6, 512
    raw = random_blocks(name, rows, cols)
    weight = repack(raw, name, rows, cols)
    want = dequantize(raw, GGMLQuantizationType[name]).astype(np.float32)
    assert weight.source == name and weight.shape == (rows, cols)
    np.testing.assert_array_equal(weight.dequantize().numpy(), want)


@pytest.mark.parametrize("name", sorted(FP16_FIELDS))
def test_repacked_blocks_multiply_like_the_dequantized_matrix(name):
    rows, cols = 40, 768
    raw = random_blocks(name, rows, cols, seed=1)
    weight = repack(raw, name, rows, cols)
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).astype(np.float32))
    for batch in (1, 5, 24):
        x = torch.randn(batch, cols)
        want = x @ dense.T
        got = quantized_linear(x, weight)
        assert (got - want).abs().max().item() <= 2e-5 * (1 + want.abs().max().item())


def test_a_type_without_a_kernel_is_left_to_dequantize():
    raw = np.zeros((2, GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1]), dtype=np.uint8)
    assert repack(raw, "Q2_K", 2, 256) is None
