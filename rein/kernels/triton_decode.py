"""Triton paged decode attention: one query token per request, split-K ("flash decoding").

Grid of the main kernel: (batch, num_kv_heads, num_splits). A program owns one request, one
KV head and one partition of `partition_size` context tokens:
  * GQA: all `group = num_heads // num_kv_heads` query heads of that KV head are one
    [group (padded to 16), head_dim] query tile, so every K/V byte is read from HBM once and
    QK^T / PV are tl.dot's (tensor cores; decode is memory-bound, so the padding is free).
  * K/V tokens are gathered BLOCK_N at a time through the block table (per-token block
    lookup, so BLOCK_N need not equal the cache block size), online softmax in fp32 with
    exp2 (the softmax scale is folded into log2(e)).
  * int8 caches: K goes into tl.dot as raw integers (exact in fp16/bf16) and its
    per-token scale multiplies the fp32 scores (O(tokens), not O(tokens * head_dim),
    multiplies). V is dequantized (int * scale in fp32, then the compute dtype) before
    the PV product, like the reference: folding its scale into the probabilities instead
    would push p * scale into fp16's subnormal range for small-valued V.
A sliding window (`window` tokens) moves each request's partitions to start at its window's
first token, so no block before the window is read (the engine may have freed it), and bounds
the number of splits by the window instead of the block table.
With more than one split each program writes its normalized partial output and its
log-sum-exp (base 2) to fp32 scratch, and the splits are merged per (request, head): by the
last program of each (request, KV head) to finish, which a per-(request, KV head) atomic ticket
names ("folded", one launch; the ticket is reset by that program, so a CUDA graph replays it),
or by `_decode_reduce_kernel`, a second launch (fold_reduce=False, the default until a GPU
has run the folded merge; or more (request, KV head)
pairs than the ticket buffer holds). At small batches the kernel is launch-bound (a batch of 1:
~90 us a call on an H200 where SDPA took 9-20 us, docs/benchmarks.md), and every split step also
paid the reduction's launch and the gap before it. With one split the main kernel writes the
output directly.

The launcher never synchronizes with the device: the grid is sized from
block_tables.shape[1] (an upper bound on any context) and programs whose partition starts
past their request's context exit at once. That keeps decode CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.kernels.triton_store import check_cache, check_index, check_rows, head_dim_pad

# Below this many tokens per split the extra partial-result traffic and the reduction
# launch cost more than the parallelism gains.
MIN_PARTITION = 256
MAX_SPLITS = 64
# Aim for about this many waves of programs over the SMs when choosing splits.
TARGET_WAVES = 2
LOG2E = 1.4426950408889634
# The kernels' window when there is none: larger than any context, so ctx - window < 0 and every
# request starts at token 0. The window is a runtime int, so windowed and full attention share
# one kernel (Triton specializes an int only on divisibility by 16: a compile or two at most).
NO_WINDOW = 2**31 - 1

# Tickets for the folded reduction: one int32 per (request, KV head), zero between launches.
TICKET_SLOTS = 1 << 16

_SM_COUNT: dict[int, int] = {}
_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device) -> torch.Tensor:
    """The device's ticket buffer, allocated (zeroed) once and kept: a captured CUDA graph holds
    its address, and every launch leaves it zero again."""
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(TICKET_SLOTS, dtype=torch.int32, device=device)
    return _TICKETS[device]


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter / tests: pretend to be an H100
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_partition(batch: int, num_kv_heads: int, max_tokens: int, block_n: int,
                     sm_count: int) -> int:
    """Tokens per split (a multiple of block_n). One split when the batch already fills the GPU.

    batch * num_kv_heads programs exist without splitting; when that is below
    TARGET_WAVES * sm_count, long contexts are cut into up to MAX_SPLITS partitions of at
    least MIN_PARTITION tokens so a few long requests still occupy every SM.
    """
    whole = triton.cdiv(max(max_tokens, 1), block_n) * block_n
    programs = batch * num_kv_heads
    want = triton.cdiv(TARGET_WAVES * sm_count, max(programs, 1))
    want = min(want, MAX_SPLITS, max_tokens // MIN_PARTITION)
    if want <= 1:
        return whole
    return triton.cdiv(triton.cdiv(max_tokens, want), block_n) * block_n


@triton.jit
def _decode_kernel(
    Q, K, V, KS, VS, BT, CL, OUT, MID_O, MID_LSE, TICKETS,
    qk_scale, partition_size, window, num_kv_heads,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_btb,
    stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SCALE: tl.constexpr, SPLIT: tl.constexpr, FOLD: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b).to(tl.int32)
    # Partitions count from the window's first token: blocks before it are never indexed.
    start = tl.maximum(ctx - window, 0) + split * partition_size

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    b64 = b.to(tl.int64)
    out_ptrs = OUT + b64 * stride_ob + heads[:, None] * stride_oh + d[None, :]
    out_mask = g_mask[:, None] & d_mask[None, :]

    if start >= ctx:
        # Partition past this request's context. Without splits this means an empty context:
        # write zeros rather than leave garbage (so does split 0 of an empty context when the
        # reduction is folded; the reduce kernel handles the unfolded case).
        if (not SPLIT) or (FOLD and split == 0):
            zeros = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=OUT.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=out_mask)
        return
    end = tl.minimum(start + partition_size, ctx)

    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = BT + b64 * stride_btb
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = n % BLOCK_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [GROUP_PAD, BLOCK_N]
        if USE_SCALE:
            ks = tl.load(KS + blk * stride_sb + off * stride_st + kvh * stride_sh, mask=n_mask, other=0.0)
            s = s * ks[None, :]
        s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
        # Every tile holds >= 1 valid token (n0 < end), so m_new is finite: no NaN guard needed.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                    mask=kv_mask, other=0.0)
        if USE_SCALE:
            vs = tl.load(VS + blk * stride_sb + off * stride_st + kvh * stride_sh, mask=n_mask, other=0.0)
            v = v.to(tl.float32) * vs[:, None]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
        m_i = m_new

    o = acc / l_i[:, None]
    if SPLIT:
        mid = MID_O + b64 * stride_mb + heads[:, None] * stride_mh + split * stride_ms + d[None, :]
        tl.store(mid, o, mask=out_mask)
        lse = MID_LSE + b64 * stride_lb + heads * stride_lh + split
        tl.store(lse, m_i + tl.log2(l_i), mask=g_mask)
        if FOLD:
            # Every thread's partial stores are issued before the ticket is taken (the barrier),
            # and the ticket's acq_rel makes them visible to whichever program merges.
            tl.debug_barrier()
            ticket_ptr = TICKETS + b * num_kv_heads + kvh
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            span = ctx - tl.maximum(ctx - window, 0)
            n_valid = (span + partition_size - 1) // partition_size
            if ticket == n_valid - 1:
                tl.atomic_xchg(ticket_ptr, 0)   # the last one: zero for the next launch
                _merge_splits(MID_O + b64 * stride_mb + heads[:, None] * stride_mh + d[None, :],
                              MID_LSE + b64 * stride_lb + heads * stride_lh, n_valid, stride_ms,
                              out_ptrs, out_mask, g_mask, GROUP_PAD, HEAD_DIM_PAD)
    else:
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_splits(mid_ptrs, lse_ptrs, n_valid, stride_ms, out_ptrs, out_mask, g_mask,
                  GROUP_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """One (request, KV head)'s GROUP query heads: merge the n_valid splits' partial outputs,
    each weighted by exp2(lse - max lse), online over the splits. Loads bypass L1 (.cg): the
    partials were written by other programs."""
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(0, n_valid):
        # Padded heads read lse 0 (not -inf) so their weights stay finite; they are never stored.
        lse = tl.load(lse_ptrs + s, mask=g_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(mid_ptrs + s * stride_ms, mask=out_mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * w[:, None]
        denom = denom * alpha + w
        m = m_new
    tl.store(out_ptrs, (acc / denom[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    MID_O, MID_LSE, CL, OUT,
    partition_size, window,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    SPLIT_TILE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # One program per (request, query head): merge the valid splits' partial outputs,
    # weighting each by exp2(lse_i - max lse). Online over tiles of SPLIT_TILE splits so any
    # split count works with bounded registers.
    b = tl.program_id(0)
    h = tl.program_id(1)
    b64 = b.to(tl.int64)
    ctx = tl.maximum(tl.load(CL + b).to(tl.int32), 0)
    span = ctx - tl.maximum(ctx - window, 0)  # tokens the query sees
    n_valid = (span + partition_size - 1) // partition_size
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, n_valid, SPLIT_TILE):
        s = s0 + tl.arange(0, SPLIT_TILE)
        s_mask = s < n_valid
        lse = tl.load(MID_LSE + b64 * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))  # finite: split s0 is valid
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # masked splits: exp2(-inf) = 0
        o = tl.load(MID_O + b64 * stride_mb + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha + tl.sum(o * w[:, None], axis=0)
        denom = denom * alpha + tl.sum(w, axis=0)
        m = m_new
    # An empty context (n_valid == 0) leaves acc = 0, denom = 0: output zeros.
    out = tl.where(denom > 0, acc / tl.maximum(denom, 1e-30), 0.0)
    tl.store(OUT + b64 * stride_ob + h * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
    *,
    partition_size: int | None = None,
    max_context_len: int | None = None,
    fold_reduce: bool = False,
) -> torch.Tensor:
    """Same contract as `reference.paged_decode_attention`; returns [B, num_heads, head_dim].

    Extra keyword-only knobs (the dispatch never passes them):
      partition_size: tokens per split; forces split-K when smaller than the context (tests).
      max_context_len: a host-side bound on context_lens, tighter than the block table's
        capacity, used only to choose the number of splits.
      fold_reduce: merge the splits in the main kernel (one launch) where the ticket buffer
        holds batch x KV heads; False (the default until the GPU check has run the folded
        merge on a device: its memory ordering cannot be checked under the interpreter): the
        separate reduce kernel.
    Requests with context_len 0 get a zero output (the reference would give NaN).
    """
    device = query.device
    check_cache(k_cache, v_cache, k_scale, v_scale, device, need_scales=True)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3:
        raise ValueError(f"query must be [batch, num_heads, head_dim], got {tuple(query.shape)}")
    batch, num_heads = query.shape[0], query.shape[1]
    check_rows("query", query, (batch, num_heads, head_dim), device)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_index("block_tables", block_tables, 2, device)
    check_index("context_lens", context_lens, 1, device)
    if block_tables.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} / context_lens {tuple(context_lens.shape)} "
            f"do not match batch {batch}"
        )
    out = torch.empty((batch, num_heads, head_dim), dtype=query.dtype, device=device)
    if batch == 0 or block_tables.shape[1] == 0:
        return out.zero_()

    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    d_pad = head_dim_pad(head_dim)
    block_n = 64 if d_pad <= 128 else 32
    max_tokens = block_tables.shape[1] * block_size
    if max_context_len is not None:
        max_tokens = min(max_tokens, max(int(max_context_len), 1))
    if window is not None:
        if window < 1:
            raise ValueError(f"window must be a positive number of tokens, got {window}")
        max_tokens = min(max_tokens, window)
    if partition_size is None:
        partition_size = choose_partition(batch, num_kv_heads, max_tokens, block_n, _sm_count(device))
    elif partition_size <= 0:
        raise ValueError(f"partition_size must be positive, got {partition_size}")
    else:
        # Forced (tests): keep tiles inside a partition without a wasted masked half-tile.
        block_n = max(16, min(block_n, triton.next_power_of_2(partition_size)))
    num_splits = triton.cdiv(max_tokens, partition_size)
    split = num_splits > 1
    fold = split and fold_reduce and batch * num_kv_heads <= TICKET_SLOTS

    use_scale = k_scale is not None
    ks, vs = (k_scale, v_scale) if use_scale else (k_cache, v_cache)  # dummies when unused
    s_strides = k_scale.stride() if use_scale else (0, 0, 0)
    if split:
        mid_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
        mid_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    else:
        mid_o = mid_lse = out  # unused
    mid_strides = mid_o.stride()[:3] if split else (0, 0, 0)
    lse_strides = mid_lse.stride()[:2] if split else (0, 0)
    # fp32 activations: IEEE fp32 products (tf32 would lose ~3 decimal digits vs the reference).
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    qk_scale = float(scale) * LOG2E

    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, ks, vs, block_tables, context_lens, out, mid_o, mid_lse,
        _tickets(device) if fold else out,
        qk_scale, partition_size, NO_WINDOW if window is None else window, num_kv_heads,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mid_strides,
        *lse_strides,
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        USE_SCALE=use_scale, SPLIT=split, FOLD=fold, DOT_PREC=dot_prec,
        num_warps=4, num_stages=2,
    )
    if split and not fold:
        _decode_reduce_kernel[(batch, num_heads)](
            mid_o, mid_lse, context_lens, out,
            partition_size, NO_WINDOW if window is None else window,
            *mid_strides,
            *lse_strides,
            out.stride(0), out.stride(1),
            SPLIT_TILE=min(16, triton.next_power_of_2(num_splits)),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
            num_warps=2 if d_pad <= 128 else 4,
        )
    return out

