"""The Triton weight-only quantized matmul (rein.kernels.triton_quantized) against the torch
definition, rein.kernels.quantized.reference_linear (dequantize, then multiply).

Without a GPU the kernel runs under the Triton interpreter on CPU tensors (TRITON_INTERPRET set
before the kernel module is imported), in float32 (the interpreter's bf16 tl.dot is wrong) and
with tiny shapes. Random integers fill every nibble and byte, so a misread layout (nibble order,
run of 32, group of a column) changes the result far beyond the tolerance.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels import triton_quantized as tq  # noqa: E402
from rein.kernels.quantized import QuantizedWeight, reference_linear  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def make_weight(bits, rows, cols, group, with_offset, seed=0):
    """A random weight: integers over their whole range, scales of both signs, offsets."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 256, (rows, cols // 2), generator=gen).to(torch.uint8)
    else:
        q = torch.randint(-128, 128, (rows, cols), generator=gen).to(torch.int8)
    scale = torch.randn(rows, cols // group, generator=gen) * 0.05
    offset = torch.randn(rows, cols // group, generator=gen) * 0.1 if with_offset else None
    return QuantizedWeight(bits, q, scale, offset, group, rows, cols).to(DEVICE)


def activations(*shape, seed=1, dtype=F32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def assert_matches(got, want, rel=1e-4):
    """Equal to float32 rounding: atol relative to the output's magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = max(want.abs().max().item(), 1e-6)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=rel * scale, rtol=rel)


# bits, group, K: groups 16/32/64 and per-channel (group == K); K = 96 with groups 16 / 32 leaves
# a part K-tile (64-column tiles), group 48 / 96 takes 16- / 32-column tiles.
LAYOUTS = [
    (4, 32, 128), (4, 64, 128), (4, 128, 128), (4, 32, 96), (4, 96, 96),
    (8, 16, 128), (8, 32, 128), (8, 64, 128), (8, 128, 128), (8, 16, 96), (8, 48, 96),
]


@pytest.mark.parametrize("with_offset", [False, True], ids=["no-offset", "offset"])
@pytest.mark.parametrize("bits, group, cols", LAYOUTS, ids=[f"{b}bit-g{g}-k{k}" for b, g, k in LAYOUTS])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_quantized_linear_equals_the_reference(bits, group, cols, with_offset, m):
    weight = make_weight(bits, 40, cols, group, with_offset)   # 40 rows: a part 64-row N tile
    x = activations(m, cols)
    assert_matches(tq.quantized_linear(x, weight), reference_linear(x, weight))


@pytest.mark.parametrize("bits, group", [(4, 32), (8, 16)])
def test_bias_and_3d_activations(bits, group):
    weight = make_weight(bits, 24, 64, group, with_offset=True, seed=3)
    x = activations(2, 5, 64, seed=4)
    bias = activations(24, seed=5)
    got = tq.quantized_linear(x, weight, bias)
    assert got.shape == (2, 5, 24)
    assert_matches(got, reference_linear(x, weight, bias))


@pytest.mark.parametrize("bits, group, cols", [(4, 32, 128), (8, 16, 96), (8, 64, 128)])
def test_many_tiles_and_split_k(bits, group, cols):
    """Several M and N tiles, the last of each partial, and K split 1..3 ways (partial sums in
    float32, bias added once), with tiles forced small."""
    weight = make_weight(bits, 40, cols, group, with_offset=True, seed=6)
    x = activations(17, cols, seed=7)
    bias = activations(40, seed=8)
    want = reference_linear(x, weight, bias)
    for split_k in (1, 2, 3):
        plan = tq.TilePlan(block_m=16, block_n=16, block_k=32, split_k=split_k)
        assert_matches(tq.launch(x, weight, bias, plan), want)


def test_each_nibble_lands_on_its_column():
    """Weight with a single 1 per row, at a column chosen to hit low and high nibbles of first
    and later runs: out[:, n] must be exactly x[:, column n]."""
    cols = [0, 15, 16, 31, 32, 47, 50, 63]
    q = torch.zeros(len(cols), 32, dtype=torch.uint8)
    for n, c in enumerate(cols):
        run, place = divmod(c, 32)
        q[n, run * 16 + place % 16] = 1 << (4 * (place // 16))
    weight = QuantizedWeight(4, q, torch.ones(len(cols), 2), None, 32, len(cols), 64).to(DEVICE)
    x = activations(3, 64, seed=9)
    torch.testing.assert_close(tq.quantized_linear(x, weight).cpu(), x[:, cols].cpu(), atol=0, rtol=0)


def test_half_precision_keeps_the_dtype():
    weight = make_weight(4, 40, 64, 32, with_offset=True, seed=10)
    x = activations(3, 64, seed=11, dtype=F16)
    got = tq.quantized_linear(x, weight)
    assert got.dtype == F16
    want = reference_linear(x.float(), weight)
    torch.testing.assert_close(got.float().cpu(), want.cpu(), atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.skipif(INTERPRET, reason="bf16 tl.dot is wrong in the Triton interpreter")
@pytest.mark.parametrize("m", [1, 300])
def test_bfloat16_on_the_gpu(m):
    weight = make_weight(4, 200, 256, 64, with_offset=True, seed=12)
    x = activations(m, 256, seed=13, dtype=BF16)
    want = reference_linear(x.float(), weight)
    got = tq.quantized_linear(x, weight)
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)


def test_empty_batch():
    weight = make_weight(8, 16, 32, 16, with_offset=False)
    assert tq.quantized_linear(activations(0, 32), weight).shape == (0, 16)


def test_tile_plan_follows_m_and_the_group():
    assert tq.plan_tiles(1, 4096, 4096, 128, None).block_m == 16
    assert tq.plan_tiles(17, 4096, 4096, 128, None).block_m == 32
    assert tq.plan_tiles(4096, 4096, 4096, 128, None).block_m == 128
    assert [tq.block_k_for(g) for g in (16, 32, 48, 64, 96, 128, 4096)] == [64, 64, 16, 64, 32, 64, 64]
    # A decode step of a 4096-row weight is 256 tiles' worth only when K is split.
    decode = tq.plan_tiles(1, 4096, 4096, 128, sm_count=132)
    assert decode.split_k > 1
    assert tq.plan_tiles(4096, 4096, 4096, 128, sm_count=132).split_k == 1
    # No rows (an empty batch on a GPU): no tiles to count, none to split (the H200 found this).
    assert tq.plan_tiles(0, 16, 32, 16, sm_count=132).split_k == 1


def test_bad_inputs_are_refused_before_launch():
    weight = make_weight(4, 16, 64, 32, with_offset=False)
    with pytest.raises(ValueError, match="columns"):
        tq.quantized_linear(activations(2, 32), weight)
    with pytest.raises(ValueError, match="activations are"):
        tq.quantized_linear(activations(2, 64).to(torch.int32), weight)
    with pytest.raises(ValueError, match="bias"):
        tq.quantized_linear(activations(2, 64), weight, activations(15))
    with pytest.raises(ValueError, match="move one"):
        tq.quantized_linear(activations(2, 64).to("meta"), weight)


# GGUF's 5- and 6-bit types held packed: (bits, group, block, zero, has scale_sub, has offset,
# has offset_sub) as rein.model.quant.gguf_blocks makes them.
PACKED = {
    "Q5_0": (5, 32, 32, 16, False, False, False),
    "Q5_1": (5, 32, 32, 0, False, True, False),
    "Q5_K": (5, 32, 256, 0, True, True, True),
    "Q6_K": (6, 16, 256, 32, True, False, False),
}


def make_packed(name, rows, cols, seed=0):
    from rein.kernels.packed_bits import pack_rows

    bits, group, block, zero, sub, offset, offset_sub = PACKED[name]
    block = min(block, cols)
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(0, 1 << bits, (rows, cols), generator=gen)

    def half(n):
        return (torch.randn(rows, n, generator=gen) * 0.02).to(torch.float16)

    def factor(low):
        return torch.randint(low, 64, (rows, cols // group), generator=gen).to(torch.int8)

    return QuantizedWeight(bits, pack_rows(ints, bits), half(cols // block), half(cols // block) if offset else None,
                           group, rows, cols, name, zero=zero, block=block,
                           scale_sub=factor(-64) if sub else None,
                           offset_sub=factor(0) if offset_sub else None).to(DEVICE)


@pytest.mark.parametrize("name", sorted(PACKED))
@pytest.mark.parametrize("cols", [256, 96])   # 96: a part K-tile (block 96 there)
@pytest.mark.parametrize("m", [1, 8])
def test_packed_5_and_6_bit_equal_the_reference(name, cols, m):
    if cols % PACKED[name][1]:
        pytest.skip("group does not divide the columns")
    weight = make_packed(name, 40, cols)
    x = activations(m, cols)
    bias = activations(40, seed=2)
    assert_matches(tq.quantized_linear(x, weight, bias), reference_linear(x, weight, bias))


def test_packed_split_k_and_small_tiles():
    weight = make_packed("Q6_K", 40, 256, seed=3)
    x = activations(17, 256, seed=4)
    want = reference_linear(x, weight)
    for split_k in (1, 3):
        plan = tq.TilePlan(block_m=16, block_n=16, block_k=32, split_k=split_k)
        assert_matches(tq.launch(x, weight, None, plan), want)


def test_each_high_bit_lands_on_its_column():
    """A single 6-bit 48 (bits 4 and 5 set, nibble 0) per row at columns hitting both nibbles and
    both plane halves of two runs: out[:, n] must be exactly 48 * x[:, column n]."""
    from rein.kernels.packed_bits import pack_rows

    cols = [0, 7, 8, 15, 16, 23, 31, 32, 40, 63]
    ints = torch.zeros(len(cols), 64, dtype=torch.int32)
    for n, c in enumerate(cols):
        ints[n, c] = 48
    weight = QuantizedWeight(6, pack_rows(ints, 6), torch.ones(len(cols), 4, dtype=torch.float16), None, 16,
                             len(cols), 64).to(DEVICE)
    x = activations(3, 64, seed=9)
    torch.testing.assert_close(tq.quantized_linear(x, weight).cpu(), 48 * x[:, cols].cpu(), atol=0, rtol=0)
