"""Per-request block tables on top of a BlockPool.

A request's table maps token positions to blocks: token t lives in block
table[t // block_size]. Its leading blocks may be prefix-cache hits shared with other
requests; the rest are its own. `cache_blocks` registers its own full, computed blocks
so later requests can hit them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .block_hash import BlockHash
from .block_pool import BlockPool


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size={block_size} must be positive")
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the prefix cache (hits included).
        self._num_cached: dict[str, int] = {}

    def computed_prefix(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of a request of `num_tokens` tokens whose
        full blocks hash to `block_hashes`. Capped so at least one token is left to compute
        (the forward pass must produce the next token's logits). Does not touch."""
        if not self.pool.enable_prefix_caching:
            return []
        max_blocks = max(0, (num_tokens - 1) // self.block_size)
        return self.pool.cached_prefix(block_hashes[:max_blocks])

    def allocate(self, request_id: str, num_tokens: int,
                 computed_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to cover `num_tokens` token slots.

        On the request's first call, `computed_block_ids` (from `computed_prefix`, called
        just before) are touched and start its table. Returns the newly allocated block
        ids, or None, changing nothing, if the pool cannot supply them.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} must be non-negative")
        table = self._tables.get(request_id)
        if table is not None and computed_block_ids:
            raise ValueError(
                f"request {request_id!r} already has a block table; pass computed_block_ids "
                f"only on its first allocate")
        hit_ids = list(computed_block_ids)
        for block_id in hit_ids:
            if self.pool.block(block_id).block_hash is None:
                raise ValueError(
                    f"prefix hit block {block_id} is no longer cached (evicted since "
                    f"computed_prefix); call computed_prefix right before allocate")
        num_have = len(table) if table is not None else len(hit_ids)
        num_new = max(0, -(-num_tokens // self.block_size) - num_have)
        # NOTE: touching a cached *free* hit takes it out of the free queue, so those hits
        # compete with the new blocks for the same free capacity.
        num_free_hits = sum(1 for b in set(hit_ids) if self.pool.block(b).ref_cnt == 0)
        if num_new + num_free_hits > self.pool.num_free_blocks:
            return None
        # Touch before allocating so the allocation cannot evict the hits.
        self.pool.touch(hit_ids)
        new_ids = self.pool.allocate(num_new)
        assert new_ids is not None, "capacity was checked above"
        if table is None:
            self._tables[request_id] = hit_ids + new_ids
            self._num_cached[request_id] = len(hit_ids)
        else:
            table.extend(new_ids)
        return new_ids

    def block_table(self, request_id: str) -> list[int]:
        """Copy of the request's block table; [] for an unknown request."""
        return list(self._tables.get(request_id, ()))

    def num_cached_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request have been registered in the prefix cache
        (a block whose hash another block already held counts, but stays uncached)."""
        return self._num_cached.get(request_id, 0)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[BlockHash],
                     num_computed_tokens: int, root: BlockHash, owner: str | None = None
                     ) -> None:
        """Register every full block whose tokens are all computed and that is not yet
        registered, for `owner` (the request's tenant). `block_hashes` are the request's
        chained full-block hashes from `root`; block 0's parent is reported as None,
        meaning 'child of root'."""
        if request_id not in self._tables:
            raise KeyError(f"unknown request {request_id!r}; allocate it first")
        del root  # the chain already starts at root; None stands for it in events
        table = self._tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes))
        assert num_full <= len(table), (
            f"request {request_id!r}: {num_full} computed blocks > table of {len(table)}")
        start = self._num_cached[request_id]
        for i in range(start, num_full):
            parent = block_hashes[i - 1] if i > 0 else None
            self.pool.cache_block(table[i], block_hashes[i], parent, owner)
        self._num_cached[request_id] = max(start, num_full)

    def free(self, request_id: str) -> None:
        """Free the request's blocks, last block first so it is evicted first, and forget
        the request. Unknown ids are ignored, so freeing twice is safe."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        del self._num_cached[request_id]
        self.pool.free(reversed(table))

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref_cnt equals its occurrences in tables."""
        self.pool.check_invariants()
        owners = Counter(b for table in self._tables.values() for b in table)
        for block_id in range(self.pool.num_blocks):
            ref_cnt = self.pool.block(block_id).ref_cnt
            assert ref_cnt == owners[block_id], (
                f"block {block_id} has ref_cnt {ref_cnt} but {owners[block_id]} table entries")
        for request_id, table in self._tables.items():
            assert self._num_cached[request_id] <= len(table), (
                f"request {request_id!r} has more cached blocks than table entries")
        assert self._num_cached.keys() == self._tables.keys(), "cached counts out of sync"
