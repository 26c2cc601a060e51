"""The fused rotary + K/V store kernel (rein.kernels.triton_rotary_store) against what it
replaces: rope.apply_rotary on q and k, then reference.store_kv. Without a GPU it runs under the
Triton interpreter on CPU tensors (TRITON_INTERPRET set before the kernel is defined), tiny shapes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels import reference  # noqa: E402
from rein.kernels.triton_rotary_store import rotary_store_kv  # noqa: E402
from rein.model.architectures.rope import RotaryEmbedding, apply_rotary  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
F32, F16, BF16, I8 = torch.float32, torch.float16, torch.bfloat16, torch.int8
# The interpreter's float32 -> bf16 casts differ from CUDA's in the last bit here: bf16 on a GPU only.
BF16_ON_GPU = pytest.param(BF16, marks=pytest.mark.skipif(DEVICE == "cpu", reason="interpreter bf16 rounding"))
HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 2, 24, 4, 6   # head_dim 24: half 12, a masked tail


def rand(*shape, dtype=F32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def step(tokens, dtype, cache_dtype, slots):
    """A fused qkv projection's views (as llama's Attention takes them), rotary tables, a cache."""
    qkv = rand(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype)
    q = qkv[:, :HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM:(HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM:].view(tokens, KV_HEADS, HEAD_DIM)
    rope = RotaryEmbedding(HEAD_DIM, 64, 10000.0, None).to(DEVICE)
    positions = torch.arange(tokens, device=DEVICE) * 3 + 1
    cos, sin = rope(positions)
    shape = (BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    caches = [rand(*shape, seed=s).to(cache_dtype) if cache_dtype != I8
              else torch.randint(-127, 128, shape, dtype=I8, device=DEVICE) for s in (1, 2)]
    scales = [rand(*shape[:3], seed=s).abs() for s in (3, 4)] if cache_dtype == I8 else [None, None]
    return qkv, q, k, v, cos, sin, caches, scales, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", [F32, F16, BF16_ON_GPU])
@pytest.mark.parametrize("cache_dtype", ["same", I8])
def test_matches_rotary_then_store(dtype, cache_dtype):
    cache_dtype = dtype if cache_dtype == "same" else cache_dtype
    slots = [5, 17, -1, 0, 22]   # scattered over blocks, one padding token
    qkv, q, k, v, cos, sin, caches, scales, slot_mapping = step(len(slots), dtype, cache_dtype, slots)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_caches = [c.clone() for c in caches]
    want_scales = [s.clone() if s is not None else None for s in scales]
    reference.store_kv(want_k, v, *want_caches, slot_mapping, *want_scales)

    assert rotary_store_kv(q, k, v, cos, sin, *caches, slot_mapping, *scales)

    # q and k rotated in place, bit for bit as apply_rotary rounds them
    assert torch.equal(q, want_q)
    assert torch.equal(k, want_k)
    # the cache holds the bytes rotary-then-store wrote, padding slot untouched
    for got, want in zip(caches + scales, want_caches + want_scales, strict=True):
        if got is not None:
            torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_declines_a_layout_it_does_not_take():
    qkv, q, k, v, cos, sin, caches, scales, slot_mapping = step(3, F32, F32, [0, 1, 2])
    before = q.clone()
    assert not rotary_store_kv(q, k, v, cos.to(F16), sin.to(F16), *caches, slot_mapping)
    assert torch.equal(q, before)


def test_rejects_a_short_slot_mapping():
    qkv, q, k, v, cos, sin, caches, scales, slot_mapping = step(3, F32, F32, [0, 1, 2])
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(q, k, v, cos, sin, *caches, slot_mapping[:2])
