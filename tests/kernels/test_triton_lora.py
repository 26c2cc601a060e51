"""The Triton LoRA kernels (rein.kernels.triton_lora) against their per-token torch reference.

Without a GPU they run under the Triton interpreter on CPU tensors (TRITON_INTERPRET set before
the kernels are defined), tiny shapes: the interpreter is ~1000x slower. There the blocks are 16
wide, so the odd sizes below (in 40, N 20, R 24) leave partial tiles and ranks 64 / 256 take
several R tiles. With a GPU the same tests run on CUDA with its block sizes, plus a
prefill-sized case and a CUDA-graph capture.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels.triton_lora import (  # noqa: E402
    LoRABatch,
    lora_expand,
    lora_shrink,
    reference_expand,
    reference_shrink,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# Against the float32 reference. float32 products are IEEE. A half out is rounded once (the
# interpreter truncates instead: up to one ulp, 2**-7 relative for bf16); on CUDA the expand
# also rounds buf to the adapter's dtype.
TOL = {F32: dict(atol=1e-4, rtol=1e-4), F16: dict(atol=1e-2, rtol=1e-2), BF16: dict(atol=5e-2, rtol=2e-2)}


def loosest(*dtypes):
    return max((TOL[dtype] for dtype in dtypes), key=lambda tol: tol["atol"])


MIXED = [0, 2, -1, 1, 0, 0, 2, -1, 1, 1, 1, 0, 2, 2, 2, 0, -1, 0, 1, 0, 2]   # 21 tokens, slot 3 idle


def adapters(ranks, max_rank, in_features, out_features, dtype=F32, seed=0):
    """lora_a [S, R, in] and lora_b [S, N, R], slot s of rank ranks[s] (zero-padded up to R)."""
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(len(ranks), max_rank, in_features, generator=gen) / in_features**0.5
    lora_b = torch.randn(len(ranks), out_features, max_rank, generator=gen)
    for slot, rank in enumerate(ranks):
        lora_a[slot, rank:] = 0
        lora_b[slot, :, rank:] = 0
    return lora_a.to(DEVICE, dtype), lora_b.to(DEVICE, dtype)


def activations(tokens, features, dtype=F32, seed=1):
    return torch.randn(tokens, features, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def slots_of(values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def check(x, lora_a, lora_b, token_slots, out, offset, split_k=None, block_m=None):
    """Run shrink and expand on `out` in place and compare both with the reference; the rows of
    slot -1 and the columns outside the slice must be left exactly as they were."""
    before = out.clone()
    batch = LoRABatch.prepare(token_slots, lora_a.shape[0], block_m=block_m)
    buf = lora_shrink(x, lora_a, batch, split_k=split_k)
    want_buf = reference_shrink(x, lora_a, token_slots)
    assert buf.dtype == F32 and buf.shape == want_buf.shape
    # x is rounded to the adapter's dtype first, which the interpreter does by truncation.
    torch.testing.assert_close(buf, want_buf, **loosest(lora_a.dtype if x.dtype != lora_a.dtype else F32))
    base = token_slots < 0
    assert (buf[base] == 0).all()
    lora_expand(buf, lora_b, out, offset, batch)
    want = reference_expand(want_buf, lora_b, before, offset, token_slots)
    assert out.dtype == before.dtype
    torch.testing.assert_close(out.float(), want.float(), **loosest(out.dtype, x.dtype, lora_b.dtype))
    n = lora_b.shape[1]
    assert torch.equal(out[base], before[base])
    assert torch.equal(out[:, :offset], before[:, :offset])
    assert torch.equal(out[:, offset + n:], before[:, offset + n:])
    return batch


def test_the_reference_is_the_per_token_formula():
    lora_a, lora_b = adapters((4, 8, 2), 8, 12, 10)
    x = activations(6, 12)
    token_slots = slots_of([2, -1, 0, 1, 1, -1])
    out = activations(6, 15, seed=3)
    got = reference_expand(reference_shrink(x, lora_a, token_slots), lora_b, out, 5, token_slots)
    want = out.clone().double()
    for t, slot in enumerate([2, -1, 0, 1, 1, -1]):
        if slot >= 0:
            want[t, 5:15] += lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, out)   # the adapters did change the adapted rows


@pytest.mark.parametrize("values", [
    MIXED,
    [1] * 37,                     # one slot, three 16-token tiles
    [-1] * 9,                     # the base alone: no tile
    [3, 3, 0, -1, 3] * 8 + [2],   # 41 tokens, block_m 16: slot 3 takes 24 (two tiles)
    list(range(5)) * 2,           # every slot once or twice: a partial tile each
])
def test_prepare_puts_every_adapted_token_once_in_one_slot_tiles(values):
    max_loras = 5
    token_slots = torch.tensor(values, dtype=torch.int32, device=DEVICE)
    batch = LoRABatch.prepare(token_slots, max_loras, block_m=16)
    tokens = len(values)
    order = batch.sorted_tokens.tolist()
    assert sorted(order) == list(range(tokens))
    keys = [values[t] if values[t] >= 0 else max_loras for t in order]
    assert keys == sorted(keys)   # sorted by slot, base tokens last
    for slot in range(max_loras):
        start, length = int(batch.seg_starts[slot]), int(batch.seg_lens[slot])
        assert length == values.count(slot)
        assert all(values[t] == slot for t in order[start:start + length])
    covered = []
    real_tiles = 0
    for slot, start, end in zip(batch.tile_slots.tolist(), batch.tile_starts.tolist(), batch.tile_ends.tolist(), strict=True):
        if slot < 0:
            continue
        real_tiles += 1
        assert 0 < end - start <= batch.block_m
        assert all(values[t] == slot for t in order[start:end])
        covered += order[start:end]
    assert sorted(covered) == [t for t in range(tokens) if values[t] >= 0]
    assert real_tiles == sum(-(-values.count(s) // 16) for s in range(max_loras))
    # The real tiles come first, then only padding: the grid is the worst case, tokens / 16 + slots.
    assert batch.tile_slots.tolist() == sorted(batch.tile_slots.tolist(), key=lambda s: s < 0)
    assert batch.num_tiles == -(-tokens // 16) + min(max_loras, tokens)


def test_prepare_rejects_what_the_kernels_cannot_take():
    with pytest.raises(ValueError, match="1-D int32/int64"):
        LoRABatch.prepare(torch.zeros(4, device=DEVICE), 2)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        LoRABatch.prepare(torch.zeros(2, 2, dtype=torch.int64, device=DEVICE), 2)
    with pytest.raises(ValueError, match="power of two"):
        LoRABatch.prepare(slots_of([0, 1]), 2, block_m=8)
    with pytest.raises(ValueError, match="max_loras"):
        LoRABatch.prepare(slots_of([0, 1]), 0)


def test_mixed_slots_into_a_slice_of_a_fused_output():
    # Ranks 8, 16 and 64 zero-padded inside R = 64 (four R tiles), slot 3 idle; in 40 and N 20 are
    # not multiples of the block; the adapter writes the columns [32, 52) of a 72-wide qkv output.
    lora_a, lora_b = adapters((8, 16, 64, 4), 64, 40, 20)
    out = activations(21, 72, seed=5)
    check(activations(21, 40), lora_a, lora_b, slots_of(MIXED), out, 32)


def test_one_slot_for_every_token():
    lora_a, lora_b = adapters((16, 8), 16, 40, 24)
    check(activations(37, 40), lora_a, lora_b, slots_of([1] * 37), activations(37, 24, seed=2), 0)


def test_the_base_alone_changes_nothing():
    lora_a, lora_b = adapters((8, 8), 8, 24, 16)
    out = activations(9, 16, seed=2)
    batch = LoRABatch.prepare(slots_of([-1] * 9), 2)
    buf = lora_shrink(activations(9, 24), lora_a, batch)
    assert torch.equal(buf, torch.zeros_like(buf))
    before = out.clone()
    lora_expand(torch.randn(9, 8, device=DEVICE), lora_b, out, 0, batch)   # even with garbage in buf
    assert torch.equal(out, before)


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_half_precision(dtype):
    lora_a, lora_b = adapters((8, 16, 24, 4), 24, 40, 20, dtype=dtype)
    out = activations(21, 50, dtype=dtype, seed=4)
    check(activations(21, 40, dtype=dtype), lora_a, lora_b, slots_of(MIXED), out, 17)


def test_float32_activations_on_bfloat16_adapters_are_rounded_first():
    lora_a, lora_b = adapters((8, 16, 8, 8), 16, 40, 20, dtype=BF16)
    check(activations(21, 40), lora_a, lora_b, slots_of(MIXED), activations(21, 20, seed=4), 0)


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_sums_the_same(split_k):
    lora_a, lora_b = adapters((8, 16, 24, 4), 24, 80, 20)   # in 80: five 16-wide blocks under the interpreter
    check(activations(21, 80), lora_a, lora_b, slots_of(MIXED), activations(21, 20, seed=2), 0, split_k=split_k)


def test_rank_256():
    lora_a, lora_b = adapters((256, 32), 256, 32, 24)
    check(activations(5, 32), lora_a, lora_b, slots_of([0, 1, -1, 0, 0]), activations(5, 24, seed=2), 0)


def test_the_three_parts_of_a_fused_qkv_on_strided_views():
    # q 32, k 16, v 16 columns of a [T, 64] output that is itself a view of a wider buffer, x a
    # column slice of a wider hidden state: the kernels go by strides.
    hidden = activations(21, 56)
    x = hidden[:, 8:48]
    assert not x.is_contiguous()
    wide = activations(21, 80, seed=6)
    qkv = wide[:, 4:68]
    token_slots = slots_of(MIXED)
    batch = LoRABatch.prepare(token_slots, 4)
    before = qkv.clone()
    want = before.clone()
    for part, (offset, n) in enumerate([(0, 32), (32, 16), (48, 16)]):
        lora_a, lora_b = adapters((8, 16, 8, 4), 16, 40, n, seed=10 + part)
        lora_expand(lora_shrink(x, lora_a, batch), lora_b, qkv, offset, batch)
        want = reference_expand(reference_shrink(x, lora_a, token_slots), lora_b, want, offset, token_slots)
    torch.testing.assert_close(qkv, want, **TOL[F32])
    assert not torch.allclose(qkv, before)
    assert torch.equal(wide[:, :4], activations(21, 80, seed=6)[:, :4])   # outside the view: untouched
    assert torch.equal(wide[:, 68:], activations(21, 80, seed=6)[:, 68:])


def test_column_major_operands():
    # x, the adapters and out each stored transposed: no operand has unit column stride.
    lora_a, lora_b = adapters((8, 16, 24, 4), 24, 40, 20)
    lora_a = lora_a.transpose(1, 2).contiguous().transpose(1, 2)
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    x = activations(40, 21).t()
    out = activations(30, 21, seed=2).t()
    assert x.stride(1) != 1 and out.stride(1) != 1 and lora_a.stride(2) != 1 and lora_b.stride(2) != 1
    check(x, lora_a, lora_b, slots_of(MIXED), out, 7)


def test_64_token_tiles():
    values = ([0] * 50 + [1] * 20 + [-1] * 5)
    lora_a, lora_b = adapters((8, 16), 16, 24, 20)
    batch = check(activations(75, 24), lora_a, lora_b, slots_of(values), activations(75, 20, seed=2), 0, block_m=64)
    assert batch.block_m == 64


def test_an_empty_step():
    lora_a, lora_b = adapters((8,), 8, 16, 16)
    batch = LoRABatch.prepare(slots_of([]), 1)
    buf = lora_shrink(activations(0, 16), lora_a, batch)
    assert buf.shape == (0, 8)
    lora_expand(buf, lora_b, activations(0, 16), 0, batch)


def test_shapes_are_checked_before_launch():
    lora_a, lora_b = adapters((8, 8), 8, 24, 16)
    batch = LoRABatch.prepare(slots_of([0, 1, -1]), 2)
    x = activations(3, 24)
    with pytest.raises(ValueError, match="3 tokens"):
        lora_shrink(activations(4, 24), lora_a, batch)
    with pytest.raises(ValueError, match="24 input features"):
        lora_shrink(activations(3, 20), lora_a, batch)
    with pytest.raises(ValueError, match="max_loras=2"):
        lora_shrink(x, lora_a[:1], batch)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        lora_shrink(x.to(torch.int32), lora_a, batch)
    with pytest.raises(ValueError, match="split_k"):
        lora_shrink(x, lora_a, batch, split_k=3)   # in 24: two blocks at most
    buf = lora_shrink(x, lora_a, batch)
    with pytest.raises(ValueError, match="float32"):
        lora_expand(buf.to(F16), lora_b, activations(3, 16), 0, batch)
    with pytest.raises(ValueError, match=r"no columns \[4, 20\)"):
        lora_expand(buf, lora_b, activations(3, 16), 4, batch)
    with pytest.raises(ValueError, match="max_loras=2"):
        lora_expand(buf, lora_b[:1], activations(3, 16), 0, batch)


@pytest.mark.skipif(INTERPRET, reason="prefill-sized shapes: GPU only")
def test_prefill_sized_step_on_the_gpu():
    values = torch.randint(-1, 8, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    lora_a, lora_b = adapters((16, 8, 64, 32, 16, 16, 8, 64), 64, 2048, 3072, dtype=BF16)
    check(activations(600, 2048, dtype=BF16), lora_a, lora_b, slots_of(values),
          activations(600, 4096, dtype=BF16, seed=2), 1024)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs: GPU only")
def test_prepare_shrink_and_expand_replay_in_a_cuda_graph():
    lora_a, lora_b = adapters((16, 8, 16, 4), 16, 256, 128, dtype=BF16)
    x = activations(21, 256, dtype=BF16)
    token_slots = slots_of(MIXED)
    out = torch.zeros(21, 128, dtype=BF16, device=DEVICE)

    def step():
        batch = LoRABatch.prepare(token_slots, 4)
        lora_expand(lora_shrink(x, lora_a, batch), lora_b, out, 0, batch)

    step()   # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_slots = slots_of([3, -1, 1, 1, 0, 2, 2, -1, 0, 3, 3, 1, 0, 0, 2, -1, 1, 1, 3, 0, 2])
    token_slots.copy_(new_slots)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = reference_expand(reference_shrink(x, lora_a, new_slots), lora_b, torch.zeros_like(out), 0, new_slots)
    torch.testing.assert_close(out.float(), want.float(), **TOL[BF16])


def test_the_layers_cuda_path_is_the_grouped_torch_path():
    """rein.model.lora.layers' CUDA path (these kernels, over a projection's parts: q, k and v of
    a fused output, each with the adapters it holds) adds what its grouped torch path adds."""
    from rein.model.lora.adapters import LoRATarget
    from rein.model.lora.layers import LoRAPart, TokensBySlot, _apply_cuda, _apply_torch

    max_loras, max_rank, in_features = 3, 16, 24
    device = torch.device(DEVICE)
    parts = [LoRAPart(offset, cols, in_features, max_loras, max_rank, device, F32)
             for offset, cols in ((0, 16), (16, 8), (24, 8))]
    generator = torch.Generator().manual_seed(7)
    for slot, rank, which in ((0, 8, (0, 1, 2)), (1, 16, (0,)), (2, 4, (1, 2))):   # slot 1 adapts q alone
        for index in which:
            part = parts[index]
            part.fill(slot, LoRATarget(None, "p", part.offset, part.offset + part.lora_b.shape[1],
                                       torch.randn(rank, in_features, generator=generator),
                                       torch.randn(part.lora_b.shape[1], rank, generator=generator)))
    slots = slots_of([1, -1, 0, 2, 2, 1, -1, 0, 1, 0, 2])
    batch = TokensBySlot.prepare(slots, device)
    batch.kernel = LoRABatch.prepare(slots, max_loras)
    x = activations(slots.numel(), in_features)
    base = torch.randn(slots.numel(), 32, generator=generator).to(DEVICE)
    got, want = base.clone(), base.clone()
    _apply_cuda(x, got, parts, batch)
    for part in parts:
        _apply_torch(x, want, part, batch)
    assert not torch.equal(want, base)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[slots == -1], base[slots == -1])
