"""LoRA on CUDA: many adapters' products in one batch as two grouped GEMMs (punica's SGMV idea).

A step's T tokens each run under one adapter slot (or -1, the base model alone). A LoRA
projection adds `(x[t] @ A[s].T) @ B[s].T` to its output row t for s = token_slots[t]; done per
adapter with torch that is a pair of small matmuls per adapter per module. Here it is two
launches per module whatever the number of adapters, the tokens grouped by slot:

    batch = LoRABatch.prepare(token_slots, max_loras)    # once per step, shared by every projection
    buf = lora_shrink(x, lora_a, batch)                   # [T, R] float32
    lora_expand(buf, lora_b, out, offset, batch)          # out[:, offset:offset + N] += ..., in place

* `LoRABatch.prepare(token_slots, max_loras)`: token_slots is an int tensor [T] on the device
  (token t runs under slot token_slots[t], -1 = base only; values must lie in [-1, max_loras),
  which is not checked here: that would need a host sync). It sorts the tokens by slot on the
  device (base tokens last), takes each slot's segment of the sorted list (`seg_starts`,
  `seg_lens`) and cuts the segments into BLOCK_M-token tiles (`tile_slots`, `tile_starts`,
  `tile_ends`): every tile belongs to one slot, so its programs read one adapter. As
  rein.kernels.triton_moe's alignment, nothing waits on the device (CUDA-graph capturable):
  the tile list is sized for the worst case, cdiv(T, BLOCK_M) + min(max_loras, T) tiles, and
  the programs of tiles past the real ones (slot -1) return at once.
* `lora_shrink(x, lora_a, batch) -> buf`: x [T, in] (float16, bfloat16 or float32),
  lora_a [S, R, in] (S = max_loras slots, R = the largest rank, smaller ranks zero-padded).
  Returns buf [T, R] float32 with buf[t] = lora_a[slot[t]] @ x[t] for tokens of slot >= 0 and
  zeros for tokens of slot -1. Grid: (tile, R tile, split of `in`); with more than one split
  the partial sums are atomically added (float32, so the last bits depend on their order).
* `lora_expand(buf, lora_b, out, offset, batch) -> None`: lora_b [S, N, R], out [T, out_total]
  (any strides: a fused projection's whole output, of which the adapter writes columns
  [offset, offset + N)). out[t, offset:offset + N] += lora_b[slot[t]] @ buf[t], accumulated in
  float32 and added in out's dtype; rows of slot -1 and columns outside the slice are not
  touched. Grid: (tile, N tile); each output element has one program, so no atomics.

Tokens are gathered through the sorted index as triton_moe gathers rows, and x's rows are cast
to the adapter's dtype before the product (as rein.model.lora.layers does). On CUDA a half
adapter's products run on tensor cores, buf rounded to the adapter's dtype for the expand;
float32 adapters run IEEE products. Under the Triton interpreter (CPU tensors, the tests) bf16
tiles are widened to float32 before tl.dot, whose interpreted bf16 product is wrong, and the
expand's add is done in float32 by hand for the same reason (the interpreter also rounds a
float32 -> bf16 cast by truncation: one ulp where CUDA rounds to nearest).

For a caller: every slot of lora_a / lora_b is read for its tokens, so a slot whose adapter does
not target this projection must hold zeros there (or its tokens must be -1 for it). The offset
is one for all slots: adapters that cover different parts of a fused output (one q only,
another q, k and v) take one expand per part, or a lora_b zero outside each adapter's part.
Values of token_slots outside [-1, max_loras) are the caller's to prevent.

`reference_shrink` / `reference_expand` are the specification: a plain per-token loop.
tests/kernels/test_triton_lora.py compares the kernels with them under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, buf_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    R, K,
    stride_xt, stride_xk, stride_as, stride_ar, stride_ak, stride_bt, stride_br,
    SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return   # a tile past the real ones (the grid is sized for the worst case)
    slot = slot.to(tl.int64)
    offs_m = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.load(tile_end_ptr + tile)
    tokens = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K * SPLIT_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(a.dtype)
        if DOT_F32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=DOT_PREC)
        x_ptrs += BLOCK_K * SPLIT_K * stride_xk
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
    buf_ptrs = buf_ptr + tokens[:, None] * stride_bt + offs_r[None, :] * stride_br
    mask = m_mask[:, None] & r_mask[None, :]
    if SPLIT_K == 1:
        tl.store(buf_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(buf_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(
    buf_ptr, b_ptr, out_ptr, sorted_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    N, R, col_offset,
    stride_bt, stride_br, stride_bs, stride_bn, stride_bk, stride_ot, stride_on,
    DOT_F32: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    slot = slot.to(tl.int64)
    offs_m = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    m_mask = offs_m < tl.load(tile_end_ptr + tile)
    tokens = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = buf_ptr + tokens[:, None] * stride_bt + offs_r[None, :] * stride_br
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_mask = offs_r < R - r0
        b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        h = tl.load(h_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        if DOT_F32:
            b = b.to(tl.float32)
        else:
            h = h.to(b.dtype)   # a half adapter: tensor-core product, float32 accumulation
        acc += tl.dot(h, b, input_precision=DOT_PREC)
        h_ptrs += BLOCK_R * stride_br
        b_ptrs += BLOCK_R * stride_bk
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + (col_offset + offs_n)[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    out_dtype = out_ptr.dtype.element_ty
    current = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    # The delta rounded to out's dtype, the sum formed in float32 and rounded once: a half add
    # done by hand (the interpreter's bf16 add is wrong).
    tl.store(out_ptrs, (current + acc.to(out_dtype).to(tl.float32)).to(out_dtype), mask=mask)


@dataclass(frozen=True)
class LoRABatch:
    """A step's tokens grouped by LoRA slot, built once per step by `prepare` (see the module).

    sorted_tokens [T] int32: token ids sorted by slot, the base tokens (slot -1) last;
    seg_starts / seg_lens [max_loras] int64: each slot's run in sorted_tokens;
    tile_slots / tile_starts / tile_ends [num_tiles] int32: the BLOCK_M-token tiles of the runs,
    a tile covering sorted_tokens[tile_starts[i]:tile_ends[i]] (at most block_m) of slot
    tile_slots[i]; tiles past the real ones have slot -1.
    """

    num_tokens: int
    max_loras: int
    block_m: int
    sorted_tokens: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    tile_slots: torch.Tensor
    tile_starts: torch.Tensor
    tile_ends: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_slots.numel()

    @property
    def device(self) -> torch.device:
        return self.sorted_tokens.device

    @classmethod
    def prepare(cls, token_slots: torch.Tensor, max_loras: int, block_m: int | None = None) -> LoRABatch:
        """Group the tokens of a step by slot, on token_slots' device and without a host sync.
        `block_m` (a power of two >= 16) overrides the tile height chosen from T."""
        if token_slots.dtype not in (torch.int32, torch.int64) or token_slots.dim() != 1:
            raise ValueError(f"token_slots must be a 1-D int32/int64 tensor [T] (got {token_slots.dtype} "
                             f"of shape {tuple(token_slots.shape)})")
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1 (got {max_loras})")
        num_tokens = token_slots.numel()
        device = token_slots.device
        if block_m is None:
            # Interpreted or decode-sized steps waste less padding on 16-token tiles; prefill
            # fills 64-token ones (as triton_moe).
            block_m = 16 if device.type != "cuda" or num_tokens <= 16 * max_loras else 64
        if block_m < 16 or block_m & (block_m - 1):
            raise ValueError(f"block_m must be a power of two of at least 16 (tl.dot's smallest tile), got {block_m}")
        # Base tokens get the key max_loras so that they sort after every adapter's run.
        keys = torch.where(token_slots < 0, max_loras, token_slots).to(torch.int64)
        order = torch.argsort(keys, stable=True)
        counts = torch.zeros(max_loras + 1, dtype=torch.int64, device=device)
        counts.scatter_add_(0, keys, torch.ones_like(keys))
        seg_lens = counts[:max_loras]
        seg_starts = seg_lens.cumsum(0) - seg_lens
        tiles = (seg_lens + block_m - 1) // block_m
        tile_ends_cum = tiles.cumsum(0)
        # Each slot with tokens pads at most one tile: the worst case, whatever the slots.
        capacity = triton.cdiv(num_tokens, block_m) + min(max_loras, num_tokens)
        index = torch.arange(capacity, device=device)
        slot = torch.searchsorted(tile_ends_cum, index, right=True)
        real = slot < max_loras
        slot = slot.clamp_(max=max_loras - 1)
        within = index - (tile_ends_cum - tiles)[slot]
        tile_starts = seg_starts[slot] + within * block_m
        tile_ends = torch.minimum(tile_starts + block_m, seg_starts[slot] + seg_lens[slot])
        return cls(
            num_tokens=num_tokens, max_loras=max_loras, block_m=block_m,
            sorted_tokens=order.to(torch.int32), seg_starts=seg_starts, seg_lens=seg_lens,
            tile_slots=torch.where(real, slot, -1).to(torch.int32),
            tile_starts=tile_starts.to(torch.int32), tile_ends=tile_ends.to(torch.int32),
        )


def _check_float(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"LoRA kernels: {name} is {tensor.dtype}; use float16, bfloat16 or float32")


def _check_device(batch: LoRABatch, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != batch.device:
            raise ValueError(f"LoRA kernels: {name} is on {tensor.device} but the batch's tokens are on {batch.device}")


def _dot_mode(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """(widen the tiles to float32, tl.dot's input precision) for an adapter of `dtype`."""
    if dtype == torch.float32:
        return True, "ieee"   # tf32 would lose about three decimal digits against the reference
    if dtype == torch.bfloat16 and device.type != "cuda":
        return True, "ieee"   # the interpreter's bf16 tl.dot is wrong
    return False, "tf32"      # ignored for half inputs


def _block(size: int, cap: int) -> int:
    return min(cap, max(16, triton.next_power_of_2(size)))


def _split_k(programs: int, k_blocks: int) -> int:
    """Splits of the reduction for a shrink of `programs` tiles: decode-sized steps have a few
    tiles and a long `in`; aim for about 256 programs (two per SM on an H100). Not tuned."""
    if programs >= 128:
        return 1
    return max(1, min(k_blocks, 256 // programs, 32))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, batch: LoRABatch, *,
                split_k: int | None = None) -> torch.Tensor:
    """buf [T, R] float32, buf[t] = lora_a[slot[t]] @ x[t] (0 for slot -1): x [T, in],
    lora_a [S, R, in]. `split_k` overrides the number of splits of `in` (None: from the shapes)."""
    if x.dim() != 2 or lora_a.dim() != 3:
        raise ValueError(f"lora_shrink takes x [T, in] and lora_a [S, R, in] "
                         f"(got {tuple(x.shape)} and {tuple(lora_a.shape)})")
    num_slots, rank, in_features = lora_a.shape
    if x.shape != (batch.num_tokens, in_features):
        raise ValueError(f"lora_shrink: x is {tuple(x.shape)}, the step has {batch.num_tokens} tokens and "
                         f"lora_a takes {in_features} input features")
    if num_slots != batch.max_loras:
        raise ValueError(f"lora_shrink: lora_a has {num_slots} slots, the batch was prepared for "
                         f"max_loras={batch.max_loras}")
    _check_float("x", x)
    _check_float("lora_a", lora_a)
    _check_device(batch, x=x, lora_a=lora_a)
    buf = torch.zeros(batch.num_tokens, rank, dtype=torch.float32, device=x.device)
    if batch.num_tokens == 0 or rank == 0:
        return buf
    on_cuda = x.device.type == "cuda"
    block_r = _block(rank, 64 if on_cuda else 16)
    block_k = _block(in_features, 64 if on_cuda else 16)
    r_tiles = triton.cdiv(rank, block_r)
    k_blocks = triton.cdiv(in_features, block_k)
    if split_k is None:
        split_k = _split_k(batch.num_tiles * r_tiles, k_blocks) if on_cuda else 1
    if not 1 <= split_k <= k_blocks:
        raise ValueError(f"lora_shrink: split_k must be in [1, {k_blocks}] for in={in_features} (got {split_k})")
    dot_f32, dot_prec = _dot_mode(lora_a.dtype, x.device)
    _shrink_kernel[(batch.num_tiles, r_tiles, split_k)](
        x, lora_a, buf, batch.sorted_tokens, batch.tile_slots, batch.tile_starts, batch.tile_ends,
        rank, in_features,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), buf.stride(0), buf.stride(1),
        SPLIT_K=split_k, DOT_F32=dot_f32, DOT_PREC=dot_prec,
        BLOCK_M=batch.block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )
    return buf


def lora_expand(buf: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, offset: int, batch: LoRABatch) -> None:
    """out[t, offset:offset + N] += lora_b[slot[t]] @ buf[t] in place (rows of slot -1 untouched):
    buf [T, R] float32 (from lora_shrink), lora_b [S, N, R], out [T, out_total], any strides."""
    if buf.dim() != 2 or lora_b.dim() != 3 or out.dim() != 2:
        raise ValueError(f"lora_expand takes buf [T, R], lora_b [S, N, R] and out [T, out_total] "
                         f"(got {tuple(buf.shape)}, {tuple(lora_b.shape)} and {tuple(out.shape)})")
    num_slots, n, rank = lora_b.shape
    if buf.shape != (batch.num_tokens, rank) or buf.dtype != torch.float32:
        raise ValueError(f"lora_expand: buf must be float32 [{batch.num_tokens}, {rank}] (the step's tokens, "
                         f"lora_b's rank), got {buf.dtype} {tuple(buf.shape)}")
    if num_slots != batch.max_loras:
        raise ValueError(f"lora_expand: lora_b has {num_slots} slots, the batch was prepared for "
                         f"max_loras={batch.max_loras}")
    if out.shape[0] != batch.num_tokens or not 0 <= offset <= out.shape[1] - n:
        raise ValueError(f"lora_expand: out {tuple(out.shape)} has no columns [{offset}, {offset + n}) "
                         f"for {batch.num_tokens} tokens")
    _check_float("lora_b", lora_b)
    _check_float("out", out)
    _check_device(batch, buf=buf, lora_b=lora_b, out=out)
    if batch.num_tokens == 0 or n == 0:
        return
    on_cuda = out.device.type == "cuda"
    block_n = _block(n, 64 if on_cuda else 16)
    block_r = _block(rank, 64 if on_cuda else 16)
    dot_f32, dot_prec = _dot_mode(lora_b.dtype, out.device)
    _expand_kernel[(batch.num_tiles, triton.cdiv(n, block_n))](
        buf, lora_b, out, batch.sorted_tokens, batch.tile_slots, batch.tile_starts, batch.tile_ends,
        n, rank, offset,
        buf.stride(0), buf.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
        out.stride(0), out.stride(1),
        DOT_F32=dot_f32, DOT_PREC=dot_prec,
        BLOCK_M=batch.block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )


def reference_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """lora_shrink's specification, a token at a time: buf[t] = A[slot[t]] @ x[t] in float32,
    x first rounded to the adapter's dtype (0 for slot -1)."""
    buf = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            buf[t] = lora_a[slot].float() @ x[t].to(lora_a.dtype).float()
    return buf


def reference_expand(buf: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor, offset: int,
                     token_slots: torch.Tensor) -> torch.Tensor:
    """lora_expand's specification, a token at a time, on a copy of out (returned):
    out[t, offset:offset + N] += (B[slot[t]] @ buf[t]) in float32, added in out's dtype."""
    result = out.clone()
    n = lora_b.shape[1]
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            result[t, offset:offset + n] += (lora_b[slot].float() @ buf[t].float()).to(out.dtype)
    return result
