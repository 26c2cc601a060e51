"""The KV cache manager (rein.engine.kv_cache_manager) alone, without a model or torch: blocks
for a request, prefix-cache hits trimmed to the windowed data, registration after a step,
forks and the copies they queue, and freeing everything."""

from __future__ import annotations

import pytest

from rein.engine.block_pool import ROOT, BlockPool, BlockPoolExhausted
from rein.engine.kv_cache_manager import BlockCopies, KVCacheManager
from rein.engine.request import Request
from rein.engine.sampling_params import SamplingParams
from rein.engine.window_blocks import WindowBlocks


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8))


def _compute(kv: KVCacheManager, request: Request, end: int) -> None:
    """What a step does for one request: blocks for the tokens, cover, compute, mark computed."""
    kv.allocate(request, kv.blocks_for(end) - len(request.block_ids))
    kv.cover([(request, end)])
    request.num_computed_tokens = end
    kv.mark_computed(request)


def test_create_builds_windowed_storage_only_when_asked():
    plain = KVCacheManager.create(8, 4, enable_caching=True)
    assert plain.windows is None and plain.window_map is None
    assert plain.num_blocks == 8 and plain.block_size == 4 and plain.enable_caching
    windowed = KVCacheManager.create(8, 4, num_windowed_blocks=3, window=5)
    assert windowed.windows is not None and windowed.windows.pool is windowed.pool
    assert windowed.window_map == [-1] * 8
    with pytest.raises(ValueError, match="own block pool"):
        KVCacheManager(BlockPool(4, 4), WindowBlocks(BlockPool(4, 4), 2, window=4))


def test_allocate_counts_and_frees_every_block():
    kv = KVCacheManager.create(4, 4)
    request = _request("a", range(1, 11))
    assert kv.can_allocate(3) and not kv.can_allocate(5)
    kv.allocate(request, kv.blocks_for(10))
    assert len(request.block_ids) == 3 and kv.num_free == 1 and kv.usage == 0.75
    kv.allocate(request, 0)   # nothing asked: nothing taken
    assert kv.num_free == 1
    with pytest.raises(BlockPoolExhausted):
        kv.allocate(request, 2)
    kv.free(request)
    assert request.block_ids == [] and kv.num_free == 4 and request.cache_parent == ROOT


def test_mark_computed_registers_full_blocks_and_a_later_request_hits_them():
    kv = KVCacheManager.create(16, 4, enable_caching=True)
    first = _request("a", range(1, 11))   # 2 full blocks + 2 tokens
    _compute(kv, first, 6)
    assert first.num_registered_blocks == 1
    _compute(kv, first, 10)
    assert first.num_registered_blocks == 2 and first.cache_parent[0] == first.block_ids[1]
    full = first.block_ids[:2]
    kv.free(first)   # the full blocks stay cached, free

    second = _request("b", [*range(1, 9), 99, 98, 97])
    cached = kv.find_cached(second, 2)
    assert cached == full
    assert kv.find_cached(second, 0) == []
    assert kv.can_allocate(kv.num_free - kv.pool.num_unheld(cached), cached)
    assert not kv.can_allocate(kv.num_free - 1, cached)   # taking a cached block uses a free one
    kv.take_cached(second, cached)
    assert second.block_ids == cached and second.num_registered_blocks == 2
    assert all(kv.pool.ref_count(b) == 1 for b in cached)
    assert second.cache_parent == (cached[1], kv.pool.generation(cached[1]))


def test_caching_off_registers_nothing():
    kv = KVCacheManager.create(8, 4)
    request = _request("a", range(1, 9))
    _compute(kv, request, 8)
    assert request.num_registered_blocks == 0 and kv.pool.num_cached == 0
    assert kv.find_cached(_request("b", range(1, 9)), 1) == []


def test_fork_shares_full_blocks_and_queues_one_copy_per_partial_block():
    kv = KVCacheManager.create(6, 4)
    parent = _request("p", range(1, 11))   # 4 + 4 + 2
    _compute(kv, parent, 10)
    children = [_request("p", range(1, 11)) for _ in range(2)]
    copies = []
    for child in children:
        assert kv.can_fork(parent)
        copies.append(kv.fork(parent, child))
    assert [src for src, _ in copies] == [parent.block_ids[2]] * 2
    assert [c.block_ids[:2] for c in children] == [parent.block_ids[:2]] * 2
    assert [kv.pool.ref_count(b) for b in parent.block_ids] == [3, 3, 1]
    taken = kv.take_copies()
    assert taken == BlockCopies(copies, None)
    assert kv.take_copies() is None   # handed out once
    # Only one block left: one more child fits, then none.
    assert kv.num_free == 1 and kv.can_fork(parent)
    kv.fork(parent, _request("p", range(1, 11)))
    assert not kv.can_fork(parent)


def test_a_fork_on_a_block_boundary_needs_no_free_block():
    kv = KVCacheManager.create(2, 4)
    parent = _request("p", range(1, 9))
    _compute(kv, parent, 8)
    assert kv.num_free == 0 and kv.can_fork(parent)
    child = _request("p", range(1, 9))
    assert kv.fork(parent, child) is None and kv.take_copies() is None
    assert child.block_ids == parent.block_ids
    kv.free(child)
    kv.free(parent)
    assert kv.num_free == 2


def test_windowed_fork_queues_the_windowed_copy_and_free_lets_go_of_the_window():
    kv = KVCacheManager.create(16, 4, num_windowed_blocks=8, window=4)
    parent = _request("p", range(1, 11))
    _compute(kv, parent, 10)
    physical = kv.window_map
    # The next query (position 10) reads keys 7..10: blocks 1 and 2 only.
    assert parent.window_first == 1 and physical[parent.block_ids[0]] == -1
    child = _request("p", range(1, 11))
    kv.fork(parent, child)
    copies = kv.take_copies()
    [(src, dst)] = copies.pairs
    assert copies.windowed == [(physical[src], physical[dst])] and physical[dst] >= 0
    assert kv.windows.num_held == 3   # blocks 1 and 2 of the parent, the child's own block 2
    for request in (child, parent):
        kv.free(request)
    assert kv.windows.num_held == 0 and kv.num_free == 16


def test_find_cached_is_trimmed_to_the_blocks_with_windowed_data():
    kv = KVCacheManager.create(16, 4, enable_caching=True, num_windowed_blocks=2, window=4)
    first = _request("a", range(1, 14))   # 3 full blocks + 1
    for end in (4, 8, 12, 13):
        _compute(kv, first, end)
    kv.free(first)
    # All three full blocks are cached, but only the last ones kept windowed data.
    assert len(kv.pool.find_prefix(first.tokens(0, 12), 3)) == 3
    second = _request("b", [*range(1, 13), 50, 51])
    cached = kv.find_cached(second, 3)
    assert 0 < len(cached) <= 3
    assert kv.windows.usable_prefix(cached) == len(cached)


def test_slot_utilization_counts_the_tokens_against_the_slots():
    kv = KVCacheManager.create(8, 4)
    a, b = _request("a", range(1, 6)), _request("b", range(1, 3))
    _compute(kv, a, 5)   # 2 blocks, 5 tokens
    _compute(kv, b, 2)   # 1 block, 2 tokens
    assert kv.slot_utilization([a, b]) == pytest.approx(7 / 12)
    assert kv.slot_utilization([]) is None
