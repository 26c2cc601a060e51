"""Sliding-window attention (`window=`) on every kernel path: the torch reference against a dense
masked SDPA written here, the native C kernels and the Triton kernels against the reference, and
blocks wholly before a window's start never read (the engine frees them: their table entries
may be -1 or blocks reused by another request).

The Triton kernels run under the interpreter on CPU tensors when there is no GPU, so
TRITON_INTERPRET is set before they are imported (as in test_triton_kernels.py); their shapes
stay small.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from kernel_builds import use_c_kernels  # noqa: E402

from rein import kernels  # noqa: E402
from rein.core.settings import get_settings  # noqa: E402
from rein.kernels import cpu_native, reference  # noqa: E402

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32   # GQA, a group of 2; head_dim a C panel multiple
SCALE = HEAD_DIM ** -0.5
# Smaller than every context, a block, a non-multiple of the block size, and longer than most
# contexts (then the window changes nothing).
WINDOWS = [1, 7, 16, 23, 200]
DECODE_LENGTHS = [1, 5, 16, 17, 40, 70]
# (q_len, context_len): a whole prompt, chunks after a cached prefix (one inside a block, one
# spanning several of the kernels' query tiles), a one-token chunk, an empty chunk.
PREFILL_REQUESTS = [(20, 20), (7, 40), (45, 70), (1, 33), (0, 9), (30, 100)]


def make_cache(lengths, seed=0, block_size=BLOCK_SIZE, head_dim=HEAD_DIM):
    """A random paged cache: each request's blocks scattered, block 0 a spare (the reference
    reads it for -1 padding, masked, so it must hold finite values as a live block does), table
    entries past a request's blocks -1."""
    g = torch.Generator().manual_seed(seed)
    per = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(per) + 1
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).to(torch.int32)
    tables = torch.full((len(lengths), max(per) + 1), -1, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per):
        tables[i, :nb] = order[used:used + nb]
        used += nb
    k = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=g)
    return k, v, tables


def prefill_inputs(requests, seed=0, block_size=BLOCK_SIZE):
    q_lens = [q for q, _ in requests]
    k, v, tables = make_cache([c for _, c in requests], seed, block_size)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1))
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor([c for _, c in requests], dtype=torch.int32)
    return query, k, v, tables, cu, lens


def decode_inputs(lengths, seed=0, block_size=BLOCK_SIZE, head_dim=HEAD_DIM):
    k, v, tables = make_cache(lengths, seed, block_size, head_dim)
    query = torch.randn(len(lengths), NUM_HEADS, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return query, k, v, tables, torch.tensor(lengths, dtype=torch.int32)


def dense_attention(query, k, v, tables, cu, lens, window):
    """The specification spelled out: per request, its K/V read token by token through the block
    table, and each query row at position p attending to keys p - window < key <= p, in float64."""
    block_size = k.shape[1]
    out = torch.empty(query.shape, dtype=torch.float64)
    for i, ctx in enumerate(lens.tolist()):
        q0, q1 = int(cu[i]), int(cu[i + 1])
        if q0 == q1:
            continue
        slots = [(int(tables[i, t // block_size]), t % block_size) for t in range(ctx)]
        keys = torch.stack([k[b, o] for b, o in slots]).double()      # [ctx, kvh, d]
        values = torch.stack([v[b, o] for b, o in slots]).double()
        q_pos = torch.arange(ctx - (q1 - q0), ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        group = NUM_HEADS // NUM_KV_HEADS
        o = torch.nn.functional.scaled_dot_product_attention(
            query[q0:q1].double().transpose(0, 1), keys.repeat_interleave(group, 1).transpose(0, 1),
            values.repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=SCALE)
        out[q0:q1] = o.transpose(0, 1)
    return out.float()


def decode_as_prefill(lens):
    """Decode is prefill of one-token chunks: its cu_seqlens_q."""
    return torch.arange(lens.shape[0] + 1, dtype=torch.int32)


def free_blocks_before_windows(k, v, tables, first_positions, window):
    """What the engine may do to blocks wholly before every row's window: fill them with NaN and
    replace their table entries, alternately, with -1 and with the (NaN) block. first_positions
    [B]: each request's earliest query position. Returns how many blocks were freed."""
    k, v, tables = k.clone(), v.clone(), tables.clone()
    block_size = k.shape[1]
    freed = 0
    for i, first in enumerate(first_positions):
        for j in range(max(0, first - window + 1) // block_size):
            block = int(tables[i, j])
            k[block] = v[block] = float("nan")
            tables[i, j] = -1 if (i + j) % 2 else block
            freed += 1
    return k, v, tables, freed


# -- the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [*WINDOWS, None])
def test_reference_decode_is_windowed_attention(window):
    query, k, v, tables, lens = decode_inputs(DECODE_LENGTHS)
    got = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
    want = dense_attention(query, k, v, tables, decode_as_prefill(lens), lens, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [*WINDOWS, None])
def test_reference_prefill_is_windowed_attention(window):
    query, k, v, tables, cu, lens = prefill_inputs(PREFILL_REQUESTS)
    got = reference.paged_prefill_attention(query, k, v, tables, cu, lens, SCALE, window=window)
    want = dense_attention(query, k, v, tables, cu, lens, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [7, 23])
def test_reference_prefill_in_chunks_equals_whole(window):
    """A prompt prefilled in three chunks (each after the cached ones) gives the rows one
    prefill of the whole prompt gives."""
    query, k, v, tables, cu, lens = prefill_inputs([(70, 70)], seed=4)
    whole = reference.paged_prefill_attention(query, k, v, tables, cu, lens, SCALE, window=window)
    for start, end in [(0, 30), (30, 31), (31, 70)]:
        part = reference.paged_prefill_attention(query[start:end], k, v, tables,
                                                 torch.tensor([0, end - start], dtype=torch.int32),
                                                 torch.tensor([end], dtype=torch.int32), SCALE, window=window)
        torch.testing.assert_close(part, whole[start:end], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 23])
def test_reference_never_reads_blocks_before_the_window(window):
    query, k, v, tables, lens = decode_inputs(DECODE_LENGTHS, seed=2)
    want = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
    k2, v2, tables2, freed = free_blocks_before_windows(k, v, tables, (lens - 1).tolist(), window)
    assert freed
    torch.testing.assert_close(reference.paged_decode_attention(query, k2, v2, tables2, lens, SCALE,
                                                                window=window), want)
    query, k, v, tables, cu, lens = prefill_inputs(PREFILL_REQUESTS, seed=3)
    want = reference.paged_prefill_attention(query, k, v, tables, cu, lens, SCALE, window=window)
    k2, v2, tables2, freed = free_blocks_before_windows(k, v, tables, (lens - cu.diff()).tolist(), window)
    assert freed
    torch.testing.assert_close(reference.paged_prefill_attention(query, k2, v2, tables2, cu, lens, SCALE,
                                                                 window=window), want)


def test_dispatch_validates_the_window():
    query, k, v, tables, lens = decode_inputs([5])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window must be a positive number of tokens"):
            kernels.paged_decode_attention(query, k, v, tables, lens, SCALE, window=bad)
    with pytest.raises(ValueError, match="window must be"):
        kernels.paged_prefill_attention(query, k, v, tables, decode_as_prefill(lens), lens, SCALE, window=0)


def test_engine_attention_passes_the_window_to_both_kernels():
    """rein.model.attention.paged_attention: a step of two decodes and a prefill chunk."""
    from rein.model.attention import AttentionMetadata, LayerCache, paged_attention

    query, k, v, tables, cu, lens = prefill_inputs([(1, 40), (1, 17), (12, 70)], seed=15)
    meta = AttentionMetadata(
        slot_mapping=torch.full((14,), -1), num_decode_tokens=2,   # the cache already holds the step
        decode_block_tables=tables[:2], decode_context_lens=lens[:2], decode_groups=None,
        prefill_block_tables=tables[2:], prefill_cu_seqlens_q=torch.tensor([0, 12], dtype=torch.int32),
        prefill_context_lens=lens[2:])
    dummy = torch.zeros(14, NUM_KV_HEADS, HEAD_DIM)
    got = paged_attention(query, dummy, dummy, LayerCache(k, v), meta, SCALE, window=7)
    torch.testing.assert_close(got, dense_attention(query, k, v, tables, cu, lens, 7), atol=2e-5, rtol=1e-5)


# -- the native C kernels --------------------------------------------------------------------


@pytest.fixture(scope="module")
def build_root(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-kernels")


@pytest.fixture(params=["native", "x86-64"], ids=["native", "portable"])
def c_kernels(request, build_root, monkeypatch):
    """The C kernels built for this CPU (its AVX2/AVX-512 loops) and for the x86-64 baseline
    (the plain loops), as in test_cpu_native.py."""
    use_c_kernels(monkeypatch, build_root, request.param)
    yield request.param
    get_settings.cache_clear()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [32, 64])   # 64: the AVX2 decode's register-held value sums
def test_c_decode_matches_reference(c_kernels, head_dim, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    query, k, v, tables, lens = decode_inputs(DECODE_LENGTHS + [300], seed=5, head_dim=head_dim)
    for window in [*WINDOWS, None]:
        got = cpu_native.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
        assert got is not None, "the native kernel did not build or load"
        want = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"window {window}")


@pytest.mark.parametrize("threads", [1, 2])
def test_c_prefill_matches_reference(c_kernels, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    args = prefill_inputs(PREFILL_REQUESTS + [(64, 300)], seed=6)
    for window in [*WINDOWS, None]:
        got = cpu_native.paged_prefill_attention(*args, SCALE, window=window)
        assert got is not None, "the native kernel did not build or load"
        want = reference.paged_prefill_attention(*args, SCALE, window=window)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"window {window}")


@pytest.mark.parametrize("window", [1, 7, 23])
def test_c_never_reads_blocks_before_the_window(c_kernels, window):
    query, k, v, tables, lens = decode_inputs(DECODE_LENGTHS + [300], seed=7)
    want = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
    k2, v2, tables2, _ = free_blocks_before_windows(k, v, tables, (lens - 1).tolist(), window)
    torch.testing.assert_close(cpu_native.paged_decode_attention(query, k2, v2, tables2, lens, SCALE,
                                                                 window=window), want, atol=2e-5, rtol=1e-5)
    query, k, v, tables, cu, lens = prefill_inputs(PREFILL_REQUESTS + [(64, 300)], seed=8)
    want = reference.paged_prefill_attention(query, k, v, tables, cu, lens, SCALE, window=window)
    k2, v2, tables2, _ = free_blocks_before_windows(k, v, tables, (lens - cu.diff()).tolist(), window)
    torch.testing.assert_close(cpu_native.paged_prefill_attention(query, k2, v2, tables2, cu, lens, SCALE,
                                                                  window=window), want, atol=2e-5, rtol=1e-5)


def test_dispatch_passes_the_window_to_the_c_kernels(c_kernels):
    query, k, v, tables, lens = decode_inputs(DECODE_LENGTHS, seed=9)
    torch.testing.assert_close(kernels.paged_decode_attention(query, k, v, tables, lens, SCALE, window=7),
                               reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=7),
                               atol=2e-5, rtol=1e-5)
    args = prefill_inputs(PREFILL_REQUESTS, seed=10)
    torch.testing.assert_close(kernels.paged_prefill_attention(*args, SCALE, window=7),
                               reference.paged_prefill_attention(*args, SCALE, window=7), atol=2e-5, rtol=1e-5)


# -- the Triton kernels ----------------------------------------------------------------------

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.fixture(scope="module")
def triton_ops():
    pytest.importorskip("triton")
    from rein.kernels import triton_ops

    return triton_ops


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("partition", [None, 16])   # 16: split-K, partitions from the window's start
def test_triton_decode_matches_reference(triton_ops, partition):
    query, k, v, tables, lens = decode_inputs([1, 17, 50, 70], seed=11)
    for window in [1, 7, 16, 23, 200]:
        got = triton_ops.paged_decode_attention(*on_device(query, k, v, tables, lens), SCALE, window=window,
                                                partition_size=partition)
        want = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
        torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0, msg=f"window {window}")


def test_triton_prefill_matches_reference(triton_ops):
    """Windows inside one key tile, across tiles (the fp32 tiles are 32 query tokens x 32 keys at
    this group), long enough for unmasked middle tiles (150 at the last request), and none."""
    args = prefill_inputs([(20, 20), (7, 40), (1, 33), (0, 9), (40, 200)], seed=12)
    for window in [1, 23, 150, None]:
        got = triton_ops.paged_prefill_attention(*on_device(*args), SCALE, window=window)
        want = reference.paged_prefill_attention(*args, SCALE, window=window)
        torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0, msg=f"window {window}")


def test_triton_never_reads_blocks_before_the_window(triton_ops):
    window = 23
    query, k, v, tables, lens = decode_inputs([17, 50, 70], seed=13)
    want = reference.paged_decode_attention(query, k, v, tables, lens, SCALE, window=window)
    k2, v2, tables2, _ = free_blocks_before_windows(k, v, tables, (lens - 1).tolist(), window)
    for partition in (None, 16):
        got = triton_ops.paged_decode_attention(*on_device(query, k2, v2, tables2, lens), SCALE, window=window,
                                                partition_size=partition)
        torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0)
    query, k, v, tables, cu, lens = prefill_inputs([(7, 40), (40, 120)], seed=14)
    want = reference.paged_prefill_attention(query, k, v, tables, cu, lens, SCALE, window=window)
    k2, v2, tables2, _ = free_blocks_before_windows(k, v, tables, (lens - cu.diff()).tolist(), window)
    got = triton_ops.paged_prefill_attention(*on_device(query, k2, v2, tables2, cu, lens), SCALE, window=window)
    torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0)
