"""A step's longest decode context is read from its metadata once (AttentionMetadata.
decode_max_context) and passed to the CPU decode kernel by every layer: the kernel's scratch is
sized by it, so the answer must be the tensor's maximum, and attention with it must equal the
reference's."""

import torch

from rein.kernels import reference
from rein.model.attention import AttentionMetadata, LayerCache, paged_attention

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 4, 16


def decode_step(lens):
    g = torch.Generator().manual_seed(0)
    blocks = 16
    cache = LayerCache(torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=g),
                       torch.randn(blocks, BLOCK, KV_HEADS, DIM, generator=g))
    tables = torch.arange(len(lens) * 4, dtype=torch.int32).view(len(lens), 4)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    slots = torch.tensor([int(t[(n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, lens, strict=True)])
    meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_context_lens=lens_t, decode_groups=None, prefill_block_tables=None,
                             prefill_cu_seqlens_q=None, prefill_context_lens=None)
    q = torch.randn(len(lens), HEADS, DIM, generator=g)
    k = torch.randn(len(lens), KV_HEADS, DIM, generator=g)
    v = torch.randn(len(lens), KV_HEADS, DIM, generator=g)
    return cache, meta, q, k, v


def test_read_once_per_step():
    _, meta, *_ = decode_step([5, 13, 2])
    assert meta.decode_max_context() == 13
    meta.decode_context_lens[1] = 3   # never done to a built step: shows the value is kept
    assert meta.decode_max_context() == 13


def test_layers_attend_as_the_reference():
    cache, meta, q, k, v = decode_step([5, 13, 2])
    want_cache = LayerCache(cache.k.clone(), cache.v.clone())
    reference.store_kv(k, v, want_cache.k, want_cache.v, meta.slot_mapping)
    want = reference.paged_decode_attention(q, want_cache.k, want_cache.v, meta.decode_block_tables,
                                            meta.decode_context_lens, 0.25)
    for _layer in range(2):   # the second layer takes the kept maximum
        got = paged_attention(q, k, v, cache, meta, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
