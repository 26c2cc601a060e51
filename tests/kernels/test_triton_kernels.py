"""Triton kernels (rein.kernels.triton_ops) against the torch reference (the specification).

Without a GPU the kernels run under the Triton interpreter on CPU tensors, so
TRITON_INTERPRET must be set before the kernel modules are imported (triton.jit reads it
when a kernel is defined). With a GPU the real kernels run on CUDA tensors instead and the
bf16 cases are added (the interpreter's bf16 tl.dot is not trustworthy). Shapes are tiny:
the interpreter is ~1000x slower than a GPU.

The launchers are called directly: the dispatch in rein.kernels sends CPU tensors to the
reference.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from rein.kernels import reference  # noqa: E402
from rein.kernels import triton_ops as tops  # noqa: E402
from rein.kernels.triton_decode import choose_partition  # noqa: E402

# Interpreted kernels (no GPU, or TRITON_INTERPRET=1 set by hand) run on CPU tensors.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
ON_GPU = not INTERPRET
BLOCK_SIZE = 16
F32, F16, BF16, I8 = torch.float32, torch.float16, torch.bfloat16, torch.int8
# bf16 only on a real GPU (see module docstring).
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="bf16 tl.dot is wrong in the Triton interpreter")

# Error tolerance of the kernel output per activation dtype (reference computed in fp32).
ATOL = {F32: 2e-4, F16: 1e-2, BF16: 3e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_cache(lengths, num_kv_heads, head_dim, cache_dtype, seed=0, spare_blocks=3,
               block_size=BLOCK_SIZE):
    """A random paged cache with each request's blocks scattered out of order.

    Returns (k_cache, v_cache, k_scale, v_scale, block_tables); block table entries past a
    request's blocks are -1. Unused blocks hold random data too, so reading a wrong block
    shows up as a mismatch.
    """
    g = _gen(seed)
    blocks_per_req = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(blocks_per_req) + spare_blocks
    order = torch.randperm(num_blocks, generator=g)
    max_blocks = max(max(blocks_per_req), 1) + 1
    tables = torch.full((len(lengths), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_req):
        tables[i, :nb] = order[used:used + nb].to(torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=g)
    v = torch.randn(shape, generator=g)
    if cache_dtype == I8:
        kq, ks = reference.quantize_int8(k.view(-1, num_kv_heads, head_dim))
        vq, vs = reference.quantize_int8(v.view(-1, num_kv_heads, head_dim))
        k_cache, v_cache = kq.view(shape), vq.view(shape)
        k_scale, v_scale = ks.view(shape[:3]), vs.view(shape[:3])
        tensors = (k_cache, v_cache, k_scale, v_scale)
    else:
        tensors = (k.to(cache_dtype), v.to(cache_dtype), None, None)
    to_dev = [t.to(DEVICE) if t is not None else None for t in tensors]
    return (*to_dev, tables.to(DEVICE))


def ref_fp32(fn, query, k_cache, v_cache, *args, k_scale=None, v_scale=None):
    """The reference in fp32 (activations and float caches upcast; int8 stays int8)."""
    kc = k_cache if k_cache.dtype == I8 else k_cache.float()
    vc = v_cache if v_cache.dtype == I8 else v_cache.float()
    return fn(query.float().cpu(), kc.cpu(), vc.cpu(), *[a.cpu() if torch.is_tensor(a) else a for a in args],
              k_scale.cpu() if k_scale is not None else None,
              v_scale.cpu() if v_scale is not None else None)


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("cache_dtype", [F32, F16, pytest.param(BF16, marks=GPU_ONLY)])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (4, 128), (3, 80)])
def test_store_kv_float(cache_dtype, num_kv_heads, head_dim):
    g = _gen(1)
    num_tokens = 21
    num_slots = 4 * BLOCK_SIZE
    # key/value as strided slices of one fused buffer, like a QKV projection output.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=g).to(DEVICE)
    key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    slots[[0, 5, 20]] = -1  # padding
    slots = slots.to(DEVICE)
    shape = (num_slots // BLOCK_SIZE, BLOCK_SIZE, num_kv_heads, head_dim)
    kc, vc = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc, vc = kc.to(DEVICE), vc.to(DEVICE)
    tops.store_kv(key, value, kc, vc, slots)
    reference.store_kv(key.cpu(), value.cpu(), kc_ref, vc_ref, slots.cpu())
    assert torch.equal(kc.cpu(), kc_ref)
    assert torch.equal(vc.cpu(), vc_ref)


@pytest.mark.parametrize("act_dtype", [F32, F16])
def test_store_kv_int8_matches_reference_exactly(act_dtype):
    g = _gen(2)
    num_tokens, kvh, d = 13, 2, 64
    key = torch.randn(num_tokens, kvh, d, generator=g) * 3
    value = torch.randn(num_tokens, kvh, d, generator=g)
    # Exact .5 ties after scaling (absmax 127 -> scale 1): torch.round goes to even.
    key[1, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    key[1, 0, 4:] = 0.0
    value[2, 1] = 0.0  # all-zero row: scale clamps at 1e-8
    key, value = key.to(act_dtype), value.to(act_dtype)
    slots = torch.tensor([3, 7, -1, 40, 0, 1, 2, 63, 17, 18, -1, 50, 33])
    shape = (4, BLOCK_SIZE, kvh, d)
    kc, vc = torch.zeros(shape, dtype=I8), torch.zeros(shape, dtype=I8)
    ks, vs = torch.zeros(shape[:3]), torch.zeros(shape[:3])
    refs = [t.clone() for t in (kc, vc, ks, vs)]
    dev = [t.to(DEVICE) for t in (kc, vc, ks, vs)]
    tops.store_kv(key.to(DEVICE), value.to(DEVICE), dev[0], dev[1], slots.to(DEVICE), dev[2], dev[3])
    reference.store_kv(key, value, refs[0], refs[1], slots, refs[2], refs[3])
    for got, want in zip(dev, refs, strict=True):
        assert torch.equal(got.cpu(), want)
    assert dev[0].cpu()[0, 7, 0, :4].tolist() == [127, 2, -4, 0]


def test_store_kv_validation():
    kc = torch.zeros(2, BLOCK_SIZE, 2, 64, device=DEVICE)
    key = torch.zeros(3, 2, 64, device=DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="key must have shape"):
        tops.store_kv(key[:, :1], key[:, :1], kc, kc.clone(), slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        tops.store_kv(key, key, kc, kc.clone(), slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        tops.store_kv(key, key, kc, kc.clone(), slots.float())
    with pytest.raises(ValueError, match="contiguous"):
        tops.store_kv(key, key, kc, kc.transpose(0, 1).contiguous().transpose(0, 1), slots)
    kq = torch.zeros(2, BLOCK_SIZE, 2, 64, dtype=I8, device=DEVICE)
    with pytest.raises(ValueError, match="int8 KV cache needs"):
        tops.store_kv(key, key, kq, kq.clone(), slots)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        bad = torch.zeros(2, BLOCK_SIZE, 2, dtype=F16, device=DEVICE)
        tops.store_kv(key, key, kq, kq.clone(), slots, bad, bad)


# ----------------------------------------------------------------------- decode attention

DECODE_CASES = [
    # group, head_dim, query dtype, cache dtype, partition_size (None = automatic)
    (1, 64, F32, F32, None),
    (2, 128, F32, F16, 16),
    (4, 64, F32, F32, 32),
    (4, 128, F16, F16, None),
    (4, 64, F32, I8, 16),
    (2, 64, F16, I8, None),
    (3, 80, F32, F32, 48),  # non-power-of-two group and head_dim; partition not a tile multiple
    pytest.param(4, 128, BF16, BF16, 32, marks=GPU_ONLY),
    pytest.param(4, 128, BF16, I8, None, marks=GPU_ONLY),
]


@pytest.mark.parametrize("group,head_dim,q_dtype,cache_dtype,partition", DECODE_CASES)
def test_decode_matches_reference(group, head_dim, q_dtype, cache_dtype, partition):
    kvh = 2
    lengths = [1, 17, 50, 32]  # 1 token, not a block multiple, several blocks, exact blocks
    kc, vc, ks, vs, tables = make_cache(lengths, kvh, head_dim, cache_dtype, seed=group + head_dim)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), kvh * group, head_dim, generator=_gen(3)).to(q_dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = tops.paged_decode_attention(query, kc, vc, tables, context_lens, scale, ks, vs,
                                      partition_size=partition)
    want = ref_fp32(reference.paged_decode_attention, query, kc, vc, tables, context_lens, scale,
                    k_scale=ks, v_scale=vs)
    assert out.dtype == q_dtype and out.shape == query.shape
    torch.testing.assert_close(out.float().cpu(), want, atol=ATOL[q_dtype], rtol=0)


def test_decode_automatic_split():
    """A long table with few programs: the launcher picks split-K on its own."""
    kvh, group, d = 2, 2, 64
    lengths = [600, 5]
    kc, vc, ks, vs, tables = make_cache(lengths, kvh, d, F32, seed=5)
    max_tokens = tables.shape[1] * BLOCK_SIZE
    partition = choose_partition(len(lengths), kvh, max_tokens, 64, 132)
    assert partition < 600  # the split path is what this test is about
    context_lens = torch.tensor(lengths, device=DEVICE)  # int64 lengths accepted too
    query = torch.randn(2, kvh * group, d, generator=_gen(6)).to(DEVICE)
    out = tops.paged_decode_attention(query, kc, vc, tables, context_lens, 0.125)
    want = ref_fp32(reference.paged_decode_attention, query, kc, vc, tables, context_lens, 0.125)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL[F32], rtol=0)


def test_choose_partition():
    # Many programs already: one split covering the whole table.
    assert choose_partition(256, 8, 4096, 64, 132) == 4096
    # Short contexts never split.
    assert choose_partition(1, 8, 300, 64, 132) == 320
    # One long request: split to roughly fill the GPU, in tile multiples >= MIN_PARTITION.
    p = choose_partition(1, 8, 32768, 64, 132)
    assert p % 64 == 0 and p >= 256
    assert 16 <= -(-32768 // p) <= 64


@pytest.mark.parametrize("cache_dtype", [F32, I8])
def test_decode_reduction_folded_or_launched_alike(cache_dtype):
    """Splits merged by the last program of each (request, KV head) equal the reduce kernel's
    merge, requests with fewer valid splits than others included, and the tickets are zero
    again afterwards (a CUDA graph replays the launch with the same buffer)."""
    from rein.kernels import triton_decode

    kvh, group, d = 2, 3, 64
    lengths = [70, 5, 33, 0]
    kc, vc, ks, vs, tables = make_cache(lengths, kvh, d, cache_dtype, seed=11)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), kvh * group, d, generator=_gen(12)).to(DEVICE)
    outs = [tops.paged_decode_attention(query, kc, vc, tables, context_lens, 0.125, ks, vs, partition_size=16,
                                        fold_reduce=fold) for fold in (True, False)]
    assert torch.equal(triton_decode._tickets(query.device), torch.zeros_like(triton_decode._tickets(query.device)))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=0)
    assert torch.equal(outs[0][3].cpu(), torch.zeros(kvh * group, d))
    want = ref_fp32(reference.paged_decode_attention, query[:3], kc, vc, tables[:3], context_lens[:3], 0.125,
                    k_scale=ks, v_scale=vs)
    torch.testing.assert_close(outs[0][:3].float().cpu(), want, atol=ATOL[F32], rtol=0)


@pytest.mark.parametrize("partition", [None, 16])
def test_decode_empty_context_gives_zeros(partition):
    kc, vc, _, _, tables = make_cache([20, 0], 1, 64, F32, seed=7)
    context_lens = torch.tensor([20, 0], dtype=torch.int32, device=DEVICE)
    query = torch.randn(2, 2, 64, generator=_gen(8)).to(DEVICE)
    out = tops.paged_decode_attention(query, kc, vc, tables, context_lens, 0.125,
                                      partition_size=partition)
    assert torch.equal(out[1].cpu(), torch.zeros(2, 64))
    want = ref_fp32(reference.paged_decode_attention, query[:1], kc, vc, tables[:1],
                    context_lens[:1], 0.125)
    torch.testing.assert_close(out[:1].cpu(), want, atol=ATOL[F32], rtol=0)


def test_decode_validation():
    kc, vc, _, _, tables = make_cache([5], 2, 64, F32)
    cl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        tops.paged_decode_attention(torch.zeros(1, 3, 64, device=DEVICE), kc, vc, tables, cl, 1.0)
    with pytest.raises(ValueError, match="query must"):
        tops.paged_decode_attention(torch.zeros(1, 4, 64, dtype=torch.float64, device=DEVICE),
                                    kc, vc, tables, cl, 1.0)
    with pytest.raises(ValueError, match="do not match batch"):
        tops.paged_decode_attention(torch.zeros(2, 4, 64, device=DEVICE), kc, vc,
                                    tables, cl, 1.0)
    with pytest.raises(ValueError, match="v_cache shape"):
        tops.paged_decode_attention(torch.zeros(1, 4, 64, device=DEVICE), kc, vc[:, :8],
                                    tables, cl, 1.0)


# ---------------------------------------------------------------------- prefill attention

PREFILL_CASES = [
    # group, head_dim, query dtype, cache dtype
    (1, 64, F32, F32),
    (2, 128, F32, F16),
    (4, 64, F32, F32),
    (2, 64, F16, F16),
    (4, 64, F32, I8),
    (3, 80, F32, F32),
    pytest.param(4, 128, BF16, BF16, marks=GPU_ONLY),
    pytest.param(4, 128, BF16, I8, marks=GPU_ONLY),
]
# (q_len, context_len) per request: single token, whole prompt, chunk after a prefix,
# an empty chunk, and a chunk spanning several query tiles after a prefix.
PREFILL_REQUESTS = [(1, 1), (20, 20), (7, 40), (0, 9), (45, 70)]


@pytest.mark.parametrize("group,head_dim,q_dtype,cache_dtype", PREFILL_CASES)
def test_prefill_matches_reference(group, head_dim, q_dtype, cache_dtype):
    kvh = 2
    q_lens = [q for q, _ in PREFILL_REQUESTS]
    lengths = [c for _, c in PREFILL_REQUESTS]
    kc, vc, ks, vs, tables = make_cache(lengths, kvh, head_dim, cache_dtype, seed=10 + group)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(sum(q_lens), kvh * group, head_dim, generator=_gen(11)).to(q_dtype).to(DEVICE)
    scale = head_dim ** -0.5
    out = tops.paged_prefill_attention(query, kc, vc, tables, cu, context_lens, scale, ks, vs)
    want = ref_fp32(reference.paged_prefill_attention, query, kc, vc, tables, cu, context_lens,
                    scale, k_scale=ks, v_scale=vs)
    assert out.dtype == q_dtype and out.shape == query.shape
    torch.testing.assert_close(out.float().cpu(), want, atol=ATOL[q_dtype], rtol=0)


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_cache_block_sizes(block_size):
    """Blocks smaller and larger than the kernels' 16/32/64-token tiles."""
    kvh, group, d = 2, 2, 64
    lengths = [45, 1, 33]  # prefill chunks below: 12 (after a prefix), 1, 33 (whole prompt)
    kc, vc, _, _, tables = make_cache(lengths, kvh, d, F32, seed=14, block_size=block_size)
    cl = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(lengths), kvh * group, d, generator=_gen(15)).to(DEVICE)
    out = tops.paged_decode_attention(query, kc, vc, tables, cl, 0.125, partition_size=16)
    want = ref_fp32(reference.paged_decode_attention, query, kc, vc, tables, cl, 0.125)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL[F32], rtol=0)
    cu = torch.tensor([0, 12, 13, 46], dtype=torch.int32, device=DEVICE)
    query = torch.randn(46, kvh * group, d, generator=_gen(16)).to(DEVICE)
    out = tops.paged_prefill_attention(query, kc, vc, tables, cu, cl, 0.125)
    want = ref_fp32(reference.paged_prefill_attention, query, kc, vc, tables, cu, cl, 0.125)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL[F32], rtol=0)


def test_prefill_strided_query():
    """query as a slice of a fused QKV buffer (head stride != head_dim * heads)."""
    kvh, group, d = 2, 2, 64
    lengths, q_lens = [30, 12], [30, 5]
    kc, vc, _, _, tables = make_cache(lengths, kvh, d, F32, seed=12)
    fused = torch.randn(sum(q_lens), kvh * group + 2 * kvh, d, generator=_gen(13)).to(DEVICE)
    query = fused[:, : kvh * group]
    cu = torch.tensor([0, 30, 35], dtype=torch.int32, device=DEVICE)
    cl = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    out = tops.paged_prefill_attention(query, kc, vc, tables, cu, cl, 0.125)
    want = ref_fp32(reference.paged_prefill_attention, query.contiguous(), kc, vc, tables, cu, cl, 0.125)
    torch.testing.assert_close(out.cpu(), want, atol=ATOL[F32], rtol=0)


def test_prefill_validation():
    kc, vc, _, _, tables = make_cache([5], 2, 64, F32)
    query = torch.zeros(5, 4, 64, device=DEVICE)
    cl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_q needs 2"):
        tops.paged_prefill_attention(query, kc, vc, tables, cl, cl, 1.0)
    with pytest.raises(ValueError, match="query must have shape"):
        tops.paged_prefill_attention(query[..., :32], kc, vc, tables,
                                     torch.tensor([0, 5], device=DEVICE), cl, 1.0)
