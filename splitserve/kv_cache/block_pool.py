"""Fixed pool of KV block ids with ref counts, an LRU free queue and a prefix cache.

A block is in exactly one of three states:

    in use        ref_cnt > 0, not in the free queue, block_hash set or None
    cached, free  ref_cnt == 0, in the free queue, block_hash set (still hittable)
    free          ref_cnt == 0, in the free queue, block_hash None

`allocate` pops the free queue's head, evicting the cached hash of a block it takes;
`free` appends to the tail. So the least recently freed block is reused first, and a
cached block survives as long as possible.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from .block_hash import HASH_SIZE, BlockHash
from .events import AllBlocksCleared, EventLog, KVEvent


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache (the key mapping to it).
    block_hash: BlockHash | None = None
    # The hash before block_hash in its chain (None: the first block); kept so that the
    # cached set can be reported as chains, as events, to a consumer that lost track.
    parent_hash: BlockHash | None = None
    # Whose cache the block is in (the tenant, for the tiers below the pool) and how often
    # it was hit since it was cached (the disk tier admits reused blocks only).
    owner: str | None = None
    hits: int = 0


# Called with a cached block about to lose its hash because its id is being reused: the
# last moment its KV can be copied to a tier below the pool (write-back).
EvictionHook = Callable[[KVBlock], None]


class BlockPool:
    """Fixed set of `num_blocks` KV blocks with ref counts, an LRU free queue and a prefix
    cache (hash -> block id). It manages ids only; the tensors live in the model runner."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be positive")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        # Head = next to reuse. OrderedDict gives O(1) append, pop-head and remove-middle.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._events: EventLog | None = None  # None: no consumer, nothing is recorded
        self.on_evict: EvictionHook | None = None  # set by an engine with tiers below

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt == 0, cached ones included (they are evictable)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def block(self, block_id: int) -> KVBlock:
        """The block record, for inspection only: mutate it through the pool's methods."""
        self._check_id(block_id)
        return self._blocks[block_id]

    def allocate(self, num: int) -> list[int] | None:
        """Take `num` blocks from the head of the free queue (ref_cnt becomes 1), evicting
        their cached hashes. None, allocating nothing, if fewer than `num` are free."""
        if num < 0:
            raise ValueError(f"cannot allocate {num} blocks")
        if num > len(self._free_queue):
            return None
        block_ids = []
        for _ in range(num):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_cnt == 0, (
                f"block {block_id} in free queue with ref_cnt {block.ref_cnt}")
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block)
            self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Sequence[int], hit: bool = True) -> None:
        """Take one more reference to each block: a prefix-cache hit reusing it, or
        (`hit=False`) a hold that keeps it from being reused without counting as one."""
        for block_id in block_ids:
            self._check_id(block_id)
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_queue[block_id]
            block.ref_cnt += 1
            block.hits += hit and block.block_hash is not None

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free queue's tail
        in the given order, keeping their hash. Pass a request's blocks in reverse order
        so its last blocks (the least shareable) are evicted first."""
        for block_id in block_ids:
            self._check_id(block_id)
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                assert block_id not in self._free_queue, f"block {block_id} already free"
                self._free_queue[block_id] = None

    def lookup(self, block_hash: BlockHash) -> int | None:
        """Id of the block cached under `block_hash`, or None."""
        return self._cached.get(block_hash)

    def cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest cached prefix of `block_hashes`. Does not touch."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cache_block(self, block_id: int, block_hash: BlockHash,
                    parent_hash: BlockHash | None, owner: str | None = None) -> None:
        """Register a full, computed, in-use block under `block_hash` (parent None: a child
        of the root) for `owner` (its tenant). If another block already holds the hash this
        one stays an uncached duplicate. No-op when prefix caching is disabled."""
        if not self.enable_prefix_caching:
            return
        self._check_id(block_id)
        if len(block_hash) != HASH_SIZE:
            raise ValueError(f"block hash has {len(block_hash)} bytes, expected {HASH_SIZE}")
        block = self._blocks[block_id]
        assert block.ref_cnt > 0, f"caching block {block_id} that is not in use"
        if block.block_hash is not None:
            assert block.block_hash == block_hash, (
                f"block {block_id} is cached as {block.block_hash.hex()}, "
                f"cannot re-cache as {block_hash.hex()}")
            return
        if block_hash in self._cached:
            return
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.owner, block.hits = owner, 0
        self._cached[block_hash] = block_id
        if self._events is not None:
            self._events.stored(block_hash, parent_hash)

    def evict_all_cached(self) -> int:
        """Drop the cached hash of every free block (reset the prefix cache); blocks in use
        keep theirs. Returns how many hashes were dropped."""
        num_evicted = 0
        for block_id in self._free_queue:
            num_evicted += self._evict(self._blocks[block_id])
        return num_evicted

    def evict_cached(self, block_hashes: Iterable[BlockHash]) -> int:
        """Drop these hashes from the prefix cache where their blocks are free (a tenant
        over its cache cap); blocks in use keep theirs. Returns how many were dropped."""
        num_evicted = 0
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is not None and self._blocks[block_id].ref_cnt == 0:
                num_evicted += self._evict(self._blocks[block_id])
        return num_evicted

    def cached_hashes(self) -> list[BlockHash]:
        return list(self._cached)

    def cached_block_ids(self) -> list[int]:
        return list(self._cached.values())

    def enable_events(self, max_pending_hashes: int | None = None) -> None:
        """Records KV events from now on, for one consumer that drains them with
        `take_events`; its first take starts with the blocks cached before. Nothing is
        recorded unless this was called, so a pool nobody drains does not grow a backlog.
        At most `max_pending_hashes` wait; past that the consumer resyncs (see
        take_events). The default, twice the pool, is more than an engine step records
        (it evicts and stores each block at most once), so a per-step drain never
        overflows in practice."""
        limit = 2 * self.num_blocks if max_pending_hashes is None else max_pending_hashes
        self._events = self._record_cached_set(EventLog(limit))

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first. After an overflow:
        AllBlocksCleared, then the cached set as BlockStored chains, which replays to the
        same view the dropped backlog would have."""
        if self._events is None:
            raise RuntimeError("KV events are not recorded on this pool; call "
                               "enable_events() before taking them")
        if not self._events.overflowed:
            return self._events.take()
        self._events.take()
        return [AllBlocksCleared(), *self._record_cached_set(EventLog(self.num_blocks)).take()]

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        assert len(self._blocks) == self.num_blocks, "block list length changed"
        zero_ids = {b.block_id for b in self._blocks if b.ref_cnt == 0}
        queue_ids = list(self._free_queue)
        assert len(set(queue_ids)) == len(queue_ids), "free queue has duplicates"
        assert set(queue_ids) == zero_ids, (
            f"free queue {sorted(queue_ids)} != ref_cnt==0 blocks {sorted(zero_ids)}")
        for i, block in enumerate(self._blocks):
            assert block.block_id == i, f"block at index {i} has id {block.block_id}"
            assert block.ref_cnt >= 0, f"block {i} has ref_cnt {block.ref_cnt}"
            if block.block_hash is None:
                assert block.parent_hash is None, f"uncached block {i} has a parent hash"
            else:
                assert self._cached.get(block.block_hash) == i, (
                    f"block {i} has hash {block.block_hash.hex()} but the cache maps it to "
                    f"{self._cached.get(block.block_hash)}")
        num_in_use = sum(1 for b in self._blocks if b.ref_cnt > 0)
        assert self.num_used_blocks == num_in_use, (
            f"{self.num_used_blocks} blocks counted used but {num_in_use} have references")
        for block_hash, block_id in self._cached.items():
            assert 0 <= block_id < self.num_blocks, f"cache maps to bad block id {block_id}"
            assert self._blocks[block_id].block_hash == block_hash, (
                f"cache maps {block_hash.hex()} to block {block_id}, whose hash is "
                f"{self._blocks[block_id].block_hash!r}")
        if not self.enable_prefix_caching:
            assert not self._cached, "prefix caching is disabled but hashes are cached"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside [0, {self.num_blocks})")

    def _evict(self, block: KVBlock) -> int:
        """Drop the block's cached hash, if any; returns 1 if it had one."""
        if block.block_hash is None:
            return 0
        removed = self._cached.pop(block.block_hash)
        assert removed == block.block_id, f"hash of block {block.block_id} mapped to {removed}"
        if self._events is not None:
            self._events.removed(block.block_hash)
        block.block_hash = block.parent_hash = block.owner = None
        block.hits = 0
        return 1

    def _record_cached_set(self, log: EventLog) -> EventLog:
        """`log` with a BlockStored for every cached block (merged into chains where the
        cache's order allows)."""
        for block_hash, block_id in self._cached.items():
            log.stored(block_hash, self._blocks[block_id].parent_hash)
        return log
