"""KV events are recorded only for an attached consumer, and a bounded backlog that
overflows still leaves the consumer with exactly the pool's cached set."""
from __future__ import annotations

import pytest

from splitserve.kv_cache import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager,
                                 KVEvent, hash_full_blocks, root_hash)
from splitserve.kv_cache.block_pool import BlockPool

BS = 4
ROOT = root_hash("fp", None)


def h(i: int) -> bytes:
    return bytes([i]) * 16


def replay(index: set[bytes], events: list[KVEvent]) -> set[bytes]:
    """A consumer's view of the cached set (the router's index, without the tree)."""
    for event in events:
        if isinstance(event, BlockStored):
            index |= set(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index -= set(event.block_hashes)
        else:
            assert isinstance(event, AllBlocksCleared)
            index = set()
    return index


def cache_chain(pool: BlockPool, hashes: list[bytes]) -> list[int]:
    ids = pool.allocate(len(hashes))
    assert ids is not None
    for i, (block_id, block_hash) in enumerate(zip(ids, hashes)):
        pool.cache_block(block_id, block_hash, hashes[i - 1] if i else None)
    return ids


def test_nothing_is_recorded_without_a_consumer() -> None:
    pool = BlockPool(4)
    pool.free(cache_chain(pool, [h(0), h(1)]))
    cache_chain(pool, [h(2), h(3), h(4)])  # evicts h(0)
    assert pool._events is None
    with pytest.raises(RuntimeError, match="enable_events"):
        pool.take_events()


def test_a_consumer_attached_late_first_gets_the_cached_set() -> None:
    pool = BlockPool(4)
    pool.free(cache_chain(pool, [h(0), h(1), h(2)]))
    pool.enable_events()
    assert pool.take_events() == [BlockStored((h(0), h(1), h(2)), None)]
    assert pool.take_events() == []


def test_an_overflowing_backlog_resyncs_the_consumer() -> None:
    pool = BlockPool(4)
    pool.enable_events(max_pending_hashes=3)
    pool.free(cache_chain(pool, [h(0), h(1)]))  # blocks 0, 1
    index = replay(set(), pool.take_events())
    pool.free(cache_chain(pool, [h(2), h(3)]))  # blocks 2, 3: 2 hashes pending
    cache_chain(pool, [h(4)])  # evicts h(0) from block 0, stores h(4): 4 hashes > 3
    assert pool._events is not None and pool._events.overflowed
    assert pool._events._pending == []  # the backlog is dropped at once, not kept
    events = pool.take_events()
    # The cached set in cache order, as chains with their parents (h(1)'s is gone).
    assert events == [AllBlocksCleared(), BlockStored((h(1),), h(0)),
                      BlockStored((h(2), h(3)), None), BlockStored((h(4),), None)]
    assert replay(index, events) == set(pool.cached_hashes())
    assert pool.take_events() == []  # back to incremental events
    assert pool.evict_all_cached() == 3
    assert pool.take_events() == [BlockRemoved((h(1), h(2), h(3)))]
    pool.check_invariants()


def test_overflow_through_the_manager_reports_whole_chains() -> None:
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.pool.enable_events(max_pending_hashes=1)
    hashes = hash_full_blocks(ROOT, list(range(4 * BS)), BS)
    assert mgr.allocate("r", 4 * BS) is not None
    mgr.cache_blocks("r", hashes, 4 * BS, ROOT)
    mgr.free("r")  # freed last block first: h0 is the last to be evicted
    assert mgr.allocate("s", BS) is not None  # evicts the chain's tail block
    events = mgr.pool.take_events()
    assert events == [AllBlocksCleared(), BlockStored(tuple(hashes[:3]), None)]
