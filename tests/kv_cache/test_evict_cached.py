"""BlockPool.evict_cached: drops free cached blocks by hash (tenant cache caps)."""
from __future__ import annotations

from splitserve.kv_cache import BlockRemoved
from splitserve.kv_cache.block_pool import BlockPool

H = [bytes([i]) * 16 for i in range(4)]


def test_evicts_free_cached_blocks_and_spares_used_ones() -> None:
    pool = BlockPool(4)
    pool.enable_events()
    ids = pool.allocate(3)
    assert ids is not None
    for i, block_id in enumerate(ids):
        pool.cache_block(block_id, H[i], H[i - 1] if i else None)
    pool.free(ids[:2])  # blocks 0 and 1 free but cached; block 2 in use
    pool.take_events()
    assert pool.evict_cached([H[0], H[2], H[3]]) == 1
    assert pool.lookup(H[0]) is None and pool.lookup(H[1]) == ids[1]
    assert pool.lookup(H[2]) == ids[2]
    assert pool.take_events() == [BlockRemoved((H[0],))]
    pool.check_invariants()
