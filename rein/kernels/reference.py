"""Plain-torch reference of every attention kernel: the specification, and the CPU path.

Cache layout (one tensor pair per layer):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads] float32, only for int8 caches
A token at slot s lives at block s // block_size, offset s % block_size. A slot of -1 is
padding and is never written.

The Triton kernels in this package compute exactly these functions on CUDA; the tests in
tests/kernels compare the two.
"""

from __future__ import annotations

import torch

INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per (token, kv head): x [T, H, D] -> (q int8 [T, H, D], scale fp32 [T, H])."""
    absmax = x.float().abs().amax(dim=-1)
    scale = (absmax / INT8_MAX).clamp(min=1e-8)
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write key/value [T, kv_heads, head_dim] into the paged cache at slot_mapping [T]."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    slots = slot_mapping.long()
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if k_cache.dtype == torch.int8:
        if k_scale is None or v_scale is None:
            raise ValueError("an int8 KV cache needs k_scale and v_scale tensors")
        kq, ks = quantize_int8(key)
        vq, vs = quantize_int8(value)
        k_flat[slots] = kq
        v_flat[slots] = vq
        k_scale.view(-1, num_kv_heads)[slots] = ks
        v_scale.view(-1, num_kv_heads)[slots] = vs
    else:
        k_flat[slots] = key.to(k_cache.dtype)
        v_flat[slots] = value.to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    block_table: torch.Tensor,
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The first `length` tokens of one request's K or V, contiguous: [length, kv_heads, head_dim]."""
    return _gather(cache, scale, block_table.unsqueeze(0), length, dtype)[0]


def _gather(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    length: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The first `length` token slots of each row's blocks: [rows, length, kv_heads, head_dim].

    index_select on a 2-D view copies whole blocks at memory speed; advanced indexing
    (cache[tables]) is several times slower on CPU.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = block_tables.shape[0]
    width = (length + block_size - 1) // block_size
    index = block_tables[:, :width].long().clamp(min=0).flatten()
    out = cache.view(num_blocks, -1).index_select(0, index)
    out = out.view(rows, width * block_size, num_kv_heads, head_dim)[:, :length]
    if scale is None:
        return out.to(dtype)
    s = scale.view(num_blocks, -1).index_select(0, index).view(rows, width * block_size, num_kv_heads)
    return out.to(dtype) * s[:, :length].unsqueeze(-1).to(dtype)


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
) -> torch.Tensor:
    """One query token per request against its cached context.

    query [B, num_heads, head_dim]; block_tables [B, max_blocks] (entries past a request's
    blocks are ignored); context_lens [B] = tokens in the cache for that request, the
    query's own token included. Returns [B, num_heads, head_dim].

    window: sliding-window attention (Mistral, Gemma 2/3): the query at position p sees only
    keys p - window < k <= p, its last `window` tokens. None is full causal attention. Block
    table entries wholly before a request's window are never read (they may be -1 or blocks
    already reused).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    max_len = int(context_lens.max())
    if window is not None and window < max_len:
        return _windowed_decode(query, k_cache, v_cache, block_tables, context_lens, scale,
                                k_scale, v_scale, window)
    # [B, L, kvh, d] -> [B, kvh, L, d]
    keys = _gather(k_cache, k_scale, block_tables, max_len, query.dtype).transpose(1, 2)
    values = _gather(v_cache, v_scale, block_tables, max_len, query.dtype).transpose(1, 2)
    group = num_heads // num_kv_heads
    # Grouped-query attention without copying K/V per query head: [B, kvh, group, d].
    q = query.view(batch, num_kv_heads, group, head_dim)
    mask = None
    if int(context_lens.min()) != max_len:  # equal lengths need no mask (a faster SDPA path)
        positions = torch.arange(max_len, device=query.device)
        mask = (positions.unsqueeze(0) < context_lens.to(query.device).unsqueeze(1))[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _windowed_decode(query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                     window: int) -> torch.Tensor:
    """Decode with a window shorter than some context: each row's block table is shifted to start
    at the block holding its window's first key, so only the window's blocks are gathered (a
    window's worth per request, whatever the context) and none before it is indexed."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    device = query.device
    lens = context_lens.to(device=device, dtype=torch.long)
    first_block = (lens - window).clamp(min=0) // block_size
    offset = first_block * block_size          # position of each row's first gathered key
    span = int((lens - offset).max())
    width = (span + block_size - 1) // block_size
    columns = first_block.unsqueeze(1) + torch.arange(width, device=device)
    # Columns past the table's end belong to no request's context: any entry will do (masked).
    tables = block_tables.to(device).gather(1, columns.clamp(max=block_tables.shape[1] - 1))
    keys = _gather(k_cache, k_scale, tables, span, query.dtype).transpose(1, 2)
    values = _gather(v_cache, v_scale, tables, span, query.dtype).transpose(1, 2)
    positions = offset.unsqueeze(1) + torch.arange(span, device=device)
    mask = (positions < lens.unsqueeze(1)) & (positions >= (lens - window).unsqueeze(1))
    q = query.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :],
                                                           scale=scale)
    return out.reshape(batch, num_heads, head_dim)


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
    """A chunk of query tokens per request, attending causally to its cache (prefix + chunk).

    query [T, num_heads, head_dim] holds the requests' chunks back to back; request i owns
    rows cu_seqlens_q[i]:cu_seqlens_q[i+1]. context_lens[i] counts its cached tokens with
    the chunk included, so the chunk's positions are context_len - q_len .. context_len - 1.
    window: as in paged_decode_attention, per query row (the row at position p sees keys
    p - window < k <= p); blocks wholly before the chunk's first row's window are never read.
    Returns [T, num_heads, head_dim].
    """
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    block_size = k_cache.shape[1]
    for i, ctx in enumerate(lengths):
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        # The chunk's first row's window reaches furthest back: blocks before it are skipped.
        first_block = 0 if window is None else max(0, ctx - q_len - window + 1) // block_size
        offset = first_block * block_size
        table = block_tables[i, first_block:]
        keys = gather_kv(k_cache, k_scale, table, ctx - offset, query.dtype)  # [L, kvh, d]
        values = gather_kv(v_cache, v_scale, table, ctx - offset, query.dtype)
        # [1, heads, q_len, d] against [1, kvh, L, d]: with enable_gqa and a plain causal mask
        # (or a bool one) torch's CPU flash kernel runs; K/V broadcast over a head group, as
        # before, sent SDPA to its unfused math path (bmm, full-size masks): twice as slow.
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)
        k = keys.transpose(0, 1).unsqueeze(0)
        v = values.transpose(0, 1).unsqueeze(0)
        windowed = window is not None and window < ctx
        if ctx == q_len and not windowed:   # the causal mask is torch's own (top-left aligned)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                 enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            k_pos = torch.arange(offset, ctx, device=query.device).unsqueeze(0)
            mask = k_pos <= q_pos  # [q_len, L]
            if windowed:
                mask &= k_pos > q_pos - window
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                                 enable_gqa=True)
        out[q0:q1] = o[0].transpose(0, 1)
    return out
