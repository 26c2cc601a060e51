"""rein.model.attention's flash prefill route (REIN_CUDA_PREFILL_ATTENTION=flash): a step whose
prompts have no cached prefix attends over its own K/V through torch's varlen flash attention.
That runs on CUDA only; here a CPU stand-in with flash's documented semantics (packed sequences
by cu_seqlens, causal, window_size=(left, right) around the diagonal, GQA) takes its place, so
what is checked is rein's side: which rows, keys and offsets it passes, and that the result
equals the paged prefill kernel's (the torch reference on CPU) on a mixed decode + prefill step."""

import pytest
import torch

from rein.model import attention
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 8


def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa):
    assert torch.equal(cu_q, cu_k) and enable_gqa and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.zeros_like(q)
    left, right = window_size
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        n = end - start
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (j <= i + right) & ((j >= i - left) if left >= 0 else True)
        kk = k[start:end].repeat_interleave(HEADS // KV_HEADS, dim=1)
        vv = v[start:end].repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], kk) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, vv)
    return out


def step(without_prefix: bool):
    """Two decodes (contexts 5 and 3, cache filled) then two fresh prompts of 3 and 6 tokens."""
    g = torch.Generator().manual_seed(0)
    blocks = 12
    cache = LayerCache(torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=g),
                       torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=g))
    decode_tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    prefill_tables = torch.tensor([[3, 0], [4, 5]], dtype=torch.int32)
    slots = [1 * BLOCK + 0, 2 * BLOCK + 2] + [3 * BLOCK + t for t in range(3)] + \
        [(4 + t // BLOCK) * BLOCK + t % BLOCK for t in range(6)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=2,
        decode_block_tables=decode_tables, decode_context_lens=torch.tensor([5, 3], dtype=torch.int32),
        decode_groups=None, prefill_block_tables=prefill_tables,
        prefill_cu_seqlens_q=torch.tensor([0, 3, 9], dtype=torch.int32),
        prefill_context_lens=torch.tensor([3, 6], dtype=torch.int32),
        prefill_without_prefix=without_prefix)
    rows = len(slots)
    q = torch.randn(rows, HEADS, DIM, generator=g)
    k = torch.randn(rows, KV_HEADS, DIM, generator=g)
    v = torch.randn(rows, KV_HEADS, DIM, generator=g)
    return q, k, v, cache, meta


@pytest.mark.parametrize("window", [None, 2])
def test_flash_route_matches_the_paged_kernel(monkeypatch, window):
    monkeypatch.setattr(attention, "flash_prefill", lambda q, meta: meta.prefill_without_prefix)
    calls = []
    monkeypatch.setattr(attention, "varlen_attn", lambda *a, **kw: calls.append(1) or fake_varlen_attn(*a, **kw))
    want = paged_attention(*step(without_prefix=False), scale=0.3, window=window)
    assert not calls
    got = paged_attention(*step(without_prefix=True), scale=0.3, window=window)
    assert calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_not_taken_on_cpu_or_unselected():
    q, _, _, _, meta = step(without_prefix=True)
    assert not attention.flash_prefill(q, meta)   # CPU tensors
