"""BlockPool: exact allocation and eviction order, prefix-cache hits, events, invariants."""
from __future__ import annotations

import pytest

from splitserve.kv_cache import BlockPool, BlockRemoved, BlockStored


def h(n: int) -> bytes:
    """A distinct fake 16-byte hash."""
    return n.to_bytes(16, "little")


def take(pool: BlockPool, num: int) -> list[int]:
    block_ids = pool.allocate(num)
    assert block_ids is not None
    return block_ids


def test_initial_state_and_allocation_order() -> None:
    pool = BlockPool(4)
    assert (pool.num_free_blocks, pool.num_used_blocks) == (4, 0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 3)
    assert [pool.block(i).ref_cnt for i in range(4)] == [1, 1, 1, 0]
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_none_when_short_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [2]
    pool.check_invariants()


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(5)
    pool.allocate(3)  # [0, 1, 2]; queue: 3 4
    pool.free([2, 1, 0])  # reverse table order; queue: 3 4 2 1 0
    assert pool.allocate(5) == [3, 4, 2, 1, 0]
    pool.check_invariants()


def test_lru_evicts_last_blocks_of_a_request_first() -> None:
    pool = BlockPool(4)
    pool.enable_events()
    ids = take(pool, 4)
    assert ids == [0, 1, 2, 3]
    for i, block_id in enumerate(ids):
        pool.cache_block(block_id, h(i), h(i - 1) if i else None)
    pool.free(reversed(ids))  # queue: 3 2 1 0
    assert pool.cached_prefix([h(0), h(1), h(2), h(3)]) == [0, 1, 2, 3]
    pool.take_events()
    assert pool.allocate(1) == [3]  # the request's last block goes first
    assert pool.lookup(h(3)) is None
    assert pool.block(3).block_hash is None
    assert pool.cached_prefix([h(0), h(1), h(2), h(3)]) == [0, 1, 2]
    assert pool.allocate(1) == [2]
    assert pool.cached_prefix([h(0), h(1), h(2)]) == [0, 1]
    assert pool.take_events() == [BlockRemoved((h(3), h(2)))]
    pool.check_invariants()


def test_hit_after_free_and_touch_takes_block_out_of_free_queue() -> None:
    pool = BlockPool(3)
    [b] = take(pool, 1)
    pool.cache_block(b, h(7), None)
    pool.free([b])
    assert pool.num_free_blocks == 3  # cached but free: still evictable
    assert pool.lookup(h(7)) == b
    pool.touch([b])
    assert pool.block(b).ref_cnt == 1
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [1, 2]  # the touched block is not handed out
    pool.touch([b])
    assert pool.block(b).ref_cnt == 2
    pool.free([b])
    pool.free([b])
    assert pool.lookup(h(7)) == b
    pool.check_invariants()


def test_cached_prefix_stops_at_first_miss() -> None:
    pool = BlockPool(4)
    ids = take(pool, 3)
    pool.cache_block(ids[0], h(0), None)
    pool.cache_block(ids[2], h(2), h(1))
    assert pool.cached_prefix([h(0), h(1), h(2)]) == [0]
    assert pool.cached_prefix([h(9)]) == []
    assert pool.block(0).ref_cnt == 1  # lookups do not touch


def test_duplicate_hash_keeps_first_block() -> None:
    pool = BlockPool(4)
    pool.enable_events()
    a, b = take(pool, 2)
    pool.cache_block(a, h(5), None)
    pool.cache_block(b, h(5), None)
    assert pool.lookup(h(5)) == a
    assert pool.block(b).block_hash is None
    pool.cache_block(a, h(5), None)  # re-caching the same block is a no-op
    assert pool.take_events() == [BlockStored((h(5),), None)]
    pool.free([b, a])
    assert pool.allocate(3) == [2, 3, b]  # the duplicate is evicted with no event
    assert pool.take_events() == []
    assert pool.lookup(h(5)) == a
    pool.check_invariants()


def test_events_in_order_and_chains_merge() -> None:
    pool = BlockPool(4)
    pool.enable_events()
    ids = take(pool, 4)
    pool.cache_block(ids[0], h(0), None)
    pool.cache_block(ids[1], h(1), h(0))  # continues the chain: merged
    pool.cache_block(ids[2], h(2), None)  # a new chain from the root
    pool.cache_block(ids[3], h(4), h(9))  # a child of a block stored elsewhere: new event
    pool.free([ids[3], ids[1]])
    assert pool.allocate(1) == [3]  # removes h(4)
    assert pool.allocate(1) == [1]  # removes h(1): merged
    pool.cache_block(ids[3], h(3), h(2))  # new event: the last one was a removal
    assert pool.take_events() == [
        BlockStored((h(0), h(1)), None),
        BlockStored((h(2),), None),
        BlockStored((h(4),), h(9)),
        BlockRemoved((h(4), h(1))),
        BlockStored((h(3),), h(2)),
    ]
    assert pool.take_events() == []


def test_evict_all_cached_only_drops_free_blocks() -> None:
    pool = BlockPool(4)
    pool.enable_events()
    ids = take(pool, 3)
    for i in ids:
        pool.cache_block(i, h(i), None)
    pool.take_events()
    pool.free([ids[2], ids[0]])
    assert pool.evict_all_cached() == 2
    assert pool.take_events() == [BlockRemoved((h(2), h(0)))]  # free-queue order
    assert pool.lookup(h(1)) == 1  # in use: kept
    assert pool.lookup(h(0)) is None and pool.lookup(h(2)) is None
    assert pool.evict_all_cached() == 0
    pool.check_invariants()


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    pool.enable_events()
    [b] = take(pool, 1)
    pool.cache_block(b, h(1), None)
    assert pool.lookup(h(1)) is None
    assert pool.take_events() == []
    pool.check_invariants()


def test_double_free_is_an_assertion() -> None:
    pool = BlockPool(2)
    [b] = take(pool, 1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_bad_input_raises_value_error() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="outside"):
        pool.touch([-1])
    with pytest.raises(ValueError, match="outside"):
        pool.touch([2])
    [b] = take(pool, 1)
    with pytest.raises(ValueError, match="bytes"):
        pool.cache_block(b, b"short", None)


def test_check_invariants_catches_corruption() -> None:
    pool = BlockPool(4)
    ids = take(pool, 2)
    pool.cache_block(ids[0], h(0), None)
    pool.check_invariants()

    pool.block(ids[1]).ref_cnt = 0  # free by count but not in the free queue
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
    pool.block(ids[1]).ref_cnt = 1

    pool.block(3).ref_cnt = 1  # in use by count but still queued
    with pytest.raises(AssertionError, match="free queue"):
        pool.check_invariants()
    pool.block(3).ref_cnt = 0

    pool.block(ids[0]).block_hash = h(9)  # block and cache map disagree
    with pytest.raises(AssertionError, match="hash"):
        pool.check_invariants()
    pool.block(ids[0]).block_hash = h(0)

    pool.block(ids[1]).ref_cnt = -1
    with pytest.raises(AssertionError):
        pool.check_invariants()
    pool.block(ids[1]).ref_cnt = 1
    pool.check_invariants()
