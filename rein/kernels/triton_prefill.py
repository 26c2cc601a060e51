"""Triton paged prefill attention: variable-length query chunks, causal over prefix + chunk.

All requests' chunks are packed back to back in `query` (rows cu_seqlens_q[i] ..
cu_seqlens_q[i+1]); the chunk of request i sits at positions context_len - q_len ..
context_len - 1, so it sees its cached prefix and, causally, itself. One launch covers
every request:

  * Grid (num_tiles, num_kv_heads). A program owns BLOCK_Q query tokens of one request and
    all GROUP query heads of one KV head, flattened into a BLOCK_M = BLOCK_Q * GROUP row
    tile (row r = token r // GROUP, head r % GROUP), so each K/V tile gathered from the
    paged cache feeds every head that shares it (GQA reads K/V once per token tile).
  * No host sync to find the tile -> request map: request i's tiles are numbered from
    cu_seqlens_q[i] // BLOCK_Q + i, which leaves at least cdiv(q_len, BLOCK_Q) tiles for
    each request, and T // BLOCK_Q + num_reqs tiles bound the total. A program
    binary-searches cu_seqlens_q for its request; spare tiles exit immediately.
  * K/V tiles of BLOCK_N tokens are gathered through the block table, scores via tl.dot,
    online softmax in fp32 with exp2. The KV loop is split: tiles entirely at or before the
    tile's first query position (and, with a window, inside its last row's window) need no
    mask; only the tiles before and after them (the diagonal) pay for masking.
  * A sliding window (`window` tokens) starts a tile's key loop at the first key its first
    query row sees, so no cache block before the window is read (the engine may have freed
    it).
  * int8 caches: as in decode, integer K goes straight into tl.dot and its per-token
    scale multiplies the fp32 scores; V is dequantized in fp32 before the PV product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rein.kernels.triton_decode import NO_WINDOW
from rein.kernels.triton_store import check_cache, check_index, check_rows, head_dim_pad

LOG2E = 1.4426950408889634


def prefill_config(head_dim_padded: int, elem_size: int, group: int) -> dict:
    """Tile sizes for H100/H200-class GPUs (no autotuning: the engine has no warm-up pass).

    16-bit: 128 query rows x 64 keys (the FlashAttention-2 sweet spot for d<=128); d=256
    halves both to stay within registers; fp32 activations halve them to fit shared memory.
    """
    if elem_size >= 4:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    elif head_dim_padded <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif head_dim_padded <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    # Every row tile must hold at least one token's full head group.
    block_m = max(block_m, triton.next_power_of_2(group))
    return {"BLOCK_M": block_m, "BLOCK_Q": block_m // group, "BLOCK_N": block_n,
            "num_warps": warps, "num_stages": stages}


@triton.jit
def _find_request(CU_Q, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """Largest request r with CU_Q[r] // BLOCK_Q + r <= tile (its first tile index)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    # Binary search for the first request whose first tile lies past `tile`; ours precedes it.
    # Request 0 starts at tile 0, so the result is >= 0.
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(CU_Q + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_pos, n0, kv_end, window, bt_row, K, V, KS, VS, kvh, qk_scale,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh, d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SCALE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One BLOCK_N-token K/V tile folded into the running softmax state. Unmasked tiles are
    visible whole to every row; masked ones apply the length, causal and window masks."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    if MASKED:
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
    off = n % BLOCK_SIZE
    k_ptrs = K + (blk * stride_kb + off * stride_kt + kvh * stride_kh)[:, None] + d[None, :]
    v_ptrs = V + (blk * stride_vb + off * stride_vt + kvh * stride_vh)[:, None] + d[None, :]
    s_off = blk * stride_sb + off * stride_st + kvh * stride_sh
    kv_mask = d_mask[None, :]
    if MASKED:
        kv_mask = n_mask[:, None] & kv_mask
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [BLOCK_M, BLOCK_N]
    if USE_SCALE:
        s = s * tl.load(KS + s_off, mask=n_mask, other=0.0)[None, :]
    s = s * qk_scale
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(n_mask[None, :] & visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = m_new
    if MASKED:
        # A row whose window starts past this tile has seen no key yet (m_new = -inf): exp2
        # against 0 instead keeps -inf - -inf (NaN) out; its p and alpha are 0, as are acc, l_i.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    if USE_SCALE:
        v = v.to(tl.float32) * tl.load(VS + s_off, mask=n_mask, other=0.0)[:, None]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _prefill_kernel(
    Q, K, V, KS, VS, BT, CU_Q, CL, OUT,
    qk_scale, num_reqs, window,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st, stride_sh,
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SCALE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = _find_request(CU_Q, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(CU_Q + req).to(tl.int32)
    q_len = tl.load(CU_Q + req + 1).to(tl.int32) - q_start
    tok0 = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if tok0 >= q_len:  # spare tile of the upper-bound grid
        return
    ctx = tl.load(CL + req).to(tl.int32)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    tok = tok0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (tok < q_len)
    io_mask = row_mask[:, None] & d_mask[None, :]
    rows64 = (q_start + tok).to(tl.int64)
    q = tl.load(Q + rows64[:, None] * stride_qt + (heads * stride_qh)[:, None] + d[None, :],
                mask=io_mask, other=0.0)
    # Padding rows (never stored) take the last row's position: like every row they see a key,
    # so no 0/0 (with a window, a position past the context could see none).
    q_pos = prefix + tl.minimum(tok, q_len - 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = BT + req.to(tl.int64) * stride_btb
    q_first = prefix + tok0
    kv_end = prefix + tl.minimum(tok0 + BLOCK_Q, q_len)  # last query position in tile + 1
    # Key tiles start at the first key the tile's first row sees (0 without a window), so no
    # block before its window is indexed. Keys [all_from, q_first] are visible to every row (the
    # last row's window start .. the first row's position): the whole tiles in that range,
    # [mid_lo, mid_hi), need no masks; the tiles before and after them do.
    kv_start = tl.maximum(q_first - window + 1, 0)
    all_from = tl.maximum(kv_end - window, 0)
    mid_lo = tl.minimum(kv_start + (all_from - kv_start + BLOCK_N - 1) // BLOCK_N * BLOCK_N, kv_end)
    mid_hi = tl.maximum(kv_start + (q_first + 1 - kv_start) // BLOCK_N * BLOCK_N, mid_lo)
    for n0 in range(kv_start, mid_lo, BLOCK_N):
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, n0, kv_end, window, bt_row, K, V, KS, VS, kvh, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_sb, stride_st, stride_sh, d, d_mask,
            BLOCK_SIZE, BLOCK_N, USE_SCALE, True, DOT_PREC,
        )
    for n0 in range(mid_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, n0, kv_end, window, bt_row, K, V, KS, VS, kvh, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_sb, stride_st, stride_sh, d, d_mask,
            BLOCK_SIZE, BLOCK_N, USE_SCALE, False, DOT_PREC,
        )
    for n0 in range(mid_hi, kv_end, BLOCK_N):
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_pos, n0, kv_end, window, bt_row, K, V, KS, VS, kvh, qk_scale,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_sb, stride_st, stride_sh, d, d_mask,
            BLOCK_SIZE, BLOCK_N, USE_SCALE, True, DOT_PREC,
        )
    o = acc / l_i[:, None]
    tl.store(OUT + rows64[:, None] * stride_ot + (heads * stride_oh)[:, None] + d[None, :],
             o.to(OUT.dtype.element_ty), mask=io_mask)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Same contract as `reference.paged_prefill_attention`; returns [T, num_heads, head_dim].

    No host synchronisation: the grid is sized from T and the number of requests.
    """
    device = query.device
    check_cache(k_cache, v_cache, k_scale, v_scale, device, need_scales=True)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    num_tokens, num_heads = query.shape[0], query.shape[1]
    check_rows("query", query, (num_tokens, num_heads, head_dim), device)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_index("block_tables", block_tables, 2, device)
    check_index("cu_seqlens_q", cu_seqlens_q, 1, device)
    check_index("context_lens", context_lens, 1, device)
    num_reqs = context_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_reqs + 1:
        raise ValueError(
            f"cu_seqlens_q needs {num_reqs + 1} entries for {num_reqs} requests, "
            f"got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.shape[0] < num_reqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_reqs} requests")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    cu_seqlens_q = cu_seqlens_q.contiguous()
    context_lens = context_lens.contiguous()

    group = num_heads // num_kv_heads
    d_pad = head_dim_pad(head_dim)
    cfg = prefill_config(d_pad, query.element_size(), group)
    use_scale = k_scale is not None
    ks, vs = (k_scale, v_scale) if use_scale else (k_cache, v_cache)  # dummies when unused
    s_strides = k_scale.stride() if use_scale else (0, 0, 0)
    dot_prec = "ieee" if query.dtype == torch.float32 else "tf32"
    grid = (num_tokens // cfg["BLOCK_Q"] + num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, ks, vs, block_tables, cu_seqlens_q, context_lens, out,
        float(scale) * LOG2E, num_reqs, NO_WINDOW if window is None else window,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *s_strides,
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad,
        BLOCK_SIZE=block_size,
        USE_SCALE=use_scale, DOT_PREC=dot_prec,
        **cfg,
    )
    return out
