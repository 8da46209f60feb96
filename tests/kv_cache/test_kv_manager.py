"""KVCacheManager: block tables, prefix hits, all-or-nothing allocation, caching."""
from __future__ import annotations

import pytest

from splitserve.kv_cache import (BlockRemoved, BlockStored, KVCacheManager, hash_full_blocks,
                                 root_hash)

ROOT = root_hash("test-model", None)
BS = 4


def hashes(tokens: list[int]) -> list[bytes]:
    return hash_full_blocks(ROOT, tokens, BS)


def run_prefill(mgr: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Hit, allocate, compute everything and cache, as the scheduler would."""
    block_hashes = hashes(tokens)
    hit = mgr.computed_prefix(block_hashes, len(tokens))
    assert mgr.allocate(request_id, len(tokens), hit) is not None
    mgr.cache_blocks(request_id, block_hashes, len(tokens), ROOT)
    return hit


def test_allocate_grows_table_with_missing_blocks_only() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    assert mgr.allocate("a", 10) == [0, 1, 2]
    assert mgr.allocate("a", 12) == []
    assert mgr.allocate("a", 13) == [3]
    assert mgr.allocate("b", 0) == []
    assert mgr.block_table("a") == [0, 1, 2, 3]
    assert mgr.block_table("b") == []
    assert mgr.block_table("nope") == []
    mgr.check_invariants()


def test_computed_prefix_leaves_one_token_to_compute() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))
    run_prefill(mgr, "a", tokens)
    assert mgr.computed_prefix(hashes(tokens), 8) == [0]  # (8 - 1) // 4 = 1 block
    assert mgr.computed_prefix(hashes(tokens + [99]), 9) == [0, 1]
    assert mgr.computed_prefix(hashes(tokens), 1) == []
    assert mgr.computed_prefix([], 0) == []


def test_prefix_hit_after_free_shares_blocks() -> None:
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    tokens = list(range(9))
    assert run_prefill(mgr, "a", tokens) == []
    assert mgr.block_table("a") == [0, 1, 2]
    assert mgr.num_cached_blocks("a") == 2
    mgr.free("a")  # free queue: 3 4 2 1 0
    hit = mgr.computed_prefix(hashes(tokens), 9)
    assert hit == [0, 1]
    assert mgr.allocate("b", 9, hit) == [3]
    assert mgr.block_table("b") == [0, 1, 3]
    assert mgr.num_cached_blocks("b") == 2
    assert mgr.pool.num_free_blocks == 2
    mgr.check_invariants()


def test_hit_on_blocks_in_use_by_another_request() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    run_prefill(mgr, "a", list(range(9)))  # blocks 0 1 2, one free
    hit = mgr.computed_prefix(hashes(list(range(9))), 9)
    assert mgr.allocate("b", 9, hit) == [3]  # hits are in use: only 1 free block needed
    assert [mgr.pool.block(i).ref_cnt for i in range(4)] == [2, 2, 1, 1]
    mgr.free("a")
    mgr.free("b")
    mgr.check_invariants()


def test_allocate_none_counts_free_hits_and_changes_nothing() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.pool.enable_events()
    tokens = list(range(9))
    run_prefill(mgr, "a", tokens)
    mgr.free("a")  # free queue: 3 2 1 0, blocks 0 1 cached
    mgr.pool.take_events()
    long_tokens = tokens[:8] + list(range(100, 109))  # 17 tokens -> 5 blocks
    hit = mgr.computed_prefix(hashes(long_tokens), 17)
    assert hit == [0, 1]
    # 3 new blocks + 2 free hits > 4 free: a naive check (3 <= 4) would pass, touch the
    # hits and then fail to allocate halfway.
    assert mgr.allocate("b", 17, hit) is None
    assert mgr.block_table("b") == []
    assert [mgr.pool.block(i).ref_cnt for i in range(4)] == [0, 0, 0, 0]
    assert mgr.pool.take_events() == []
    mgr.check_invariants()
    # 2 new + 2 free hits fit exactly.
    assert mgr.allocate("b", 16, hit) == [3, 2]
    assert mgr.block_table("b") == [0, 1, 3, 2]
    assert mgr.pool.num_free_blocks == 0
    assert mgr.allocate("b", 17) is None
    assert mgr.block_table("b") == [0, 1, 3, 2]
    mgr.check_invariants()


def test_cache_blocks_incrementally_with_chained_parents() -> None:
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    mgr.pool.enable_events()
    tokens = list(range(14))
    hs = hashes(tokens)
    mgr.allocate("a", 14)
    mgr.cache_blocks("a", hs, 7, ROOT)  # only block 0 is fully computed
    assert mgr.num_cached_blocks("a") == 1
    assert mgr.pool.take_events() == [BlockStored((hs[0],), None)]
    mgr.cache_blocks("a", hs, 7, ROOT)  # nothing new
    mgr.cache_blocks("a", hs, 14, ROOT)
    assert mgr.num_cached_blocks("a") == 3
    assert mgr.pool.take_events() == [BlockStored((hs[1], hs[2]), hs[0])]
    assert mgr.pool.cached_prefix(hs) == [0, 1, 2]
    mgr.cache_blocks("a", hs[:2], 14, ROOT)  # limited by the hashes given: no change
    assert mgr.num_cached_blocks("a") == 3
    mgr.check_invariants()


def test_concurrent_duplicates_stay_uncached_and_evict_silently() -> None:
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    mgr.pool.enable_events()
    tokens = list(range(9))
    mgr.allocate("a", 9)
    mgr.allocate("b", 9)  # no hit yet: both compute the same prompt
    mgr.cache_blocks("a", hashes(tokens), 9, ROOT)
    mgr.cache_blocks("b", hashes(tokens), 9, ROOT)
    assert mgr.num_cached_blocks("b") == 2
    assert [mgr.pool.block(i).block_hash is not None for i in range(6)] == [
        True, True, False, False, False, False]
    mgr.pool.take_events()
    mgr.free("b")  # b's table is [3, 4, 5]: queue 5 4 3
    mgr.free("a")  # queue 5 4 3 2 1 0
    assert mgr.pool.allocate(4) == [5, 4, 3, 2]
    assert mgr.pool.take_events() == []  # none of those was cached
    assert mgr.pool.cached_prefix(hashes(tokens)) == [0, 1]
    mgr.pool.free([5, 4, 3, 2])
    mgr.check_invariants()


def test_free_reverse_order_and_idempotent() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.pool.enable_events()
    tokens = list(range(12))
    run_prefill(mgr, "a", tokens)
    mgr.pool.take_events()
    mgr.free("a")
    mgr.free("a")
    mgr.free("never-seen")
    assert mgr.block_table("a") == []
    assert mgr.num_cached_blocks("a") == 0
    assert mgr.allocate("b", 4) == [3]
    assert mgr.allocate("c", 4) == [2]  # a's last block is evicted first
    assert mgr.pool.take_events() == [BlockRemoved((hashes(tokens)[2],))]
    mgr.check_invariants()


def test_prefix_caching_disabled() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    mgr.pool.enable_events()
    tokens = list(range(9))
    run_prefill(mgr, "a", tokens)
    mgr.free("a")
    assert mgr.computed_prefix(hashes(tokens), 9) == []
    assert mgr.pool.take_events() == []
    mgr.check_invariants()


def test_bad_input() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError):
        mgr.allocate("a", -1)
    with pytest.raises(KeyError):
        mgr.cache_blocks("a", [], 0, ROOT)
    mgr.allocate("a", 4)
    with pytest.raises(ValueError, match="first allocate"):
        mgr.allocate("a", 8, [0])
    with pytest.raises(ValueError, match="no longer cached"):
        mgr.allocate("b", 8, [1])  # block 1 is not a cached block
    mgr.check_invariants()


def test_check_invariants_catches_ref_count_drift() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.allocate("a", 8)
    mgr.check_invariants()
    mgr._tables["a"].append(0)  # a table entry with no reference behind it
    with pytest.raises(AssertionError, match="ref_cnt"):
        mgr.check_invariants()
    mgr._tables["a"].pop()
    mgr.pool.block(1).ref_cnt = 2  # a reference with no table entry behind it
    with pytest.raises(AssertionError, match="ref_cnt"):
        mgr.check_invariants()
