"""Tiers below the engine's block pool: what the engine asks of them, and the bridge that
moves blocks between them and the KV tensor.

The engine never imports the store (`splitserve.store` implements `KVTiers`), as with
the KV connector. Two moments matter:

    write-back   the pool is about to reuse a cached block's id (its hash is evicted):
                 the block's KV goes down (`KVTiers.offload`) before it is overwritten.
    promotion    a waiting request's prefix continues below the pool: those blocks come
                 up into free pool blocks, are cached under their hashes, and the request
                 then hits them like any tier-0 block. The bytes are the ones computed, so
                 the output is exactly that of a cold run.

A block's payload is its KV for every layer, K then V, in the cache's dtype and the layout
`[num_layers, 2, block_size, num_kv_heads, head_dim]`: `KVLayout` says the shape, the
fingerprint says whose KV it is (the store keeps one fingerprint per directory).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.engine.kv_connector import KVLayout
from splitserve.kv_cache import BlockHash, KVBlock, KVCacheManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TieredBlock:
    """A block going below the pool: its chain position and owner."""
    block_hash: BlockHash
    parent_hash: BlockHash | None  # None: the first block of its sequence
    tenant: str | None
    reused: bool  # hit at least once while in the pool (the disk tier admits those)


class KVTiers(Protocol):
    """The tiers below the pool, as the engine sees them. Engine thread; every call
    returns without waiting on a disk or a peer for longer than its own deadline."""

    def offload(self, block: TieredBlock, payload: memoryview) -> None:
        """Keep this block's KV below (a copy: `payload` is reused after the call)."""

    def available(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> int:
        """How many leading blocks of `block_hashes` the tiers hold for `tenant`."""

    def load(self, block_hash: BlockHash, tenant: str | None) -> bytes | memoryview | None:
        """The block's payload, or None (gone since `available`, corrupt, not the
        tenant's): the caller recomputes from there."""


class TierBridge:
    """Moves blocks between the pool's KV tensor and `tiers` (see the module docstring)."""

    def __init__(self, kv: KVCacheManager, kv_cache: torch.Tensor, layout: KVLayout,
                 tiers: KVTiers) -> None:
        self.kv, self.kv_cache, self.tiers = kv, kv_cache, tiers
        self.block_shape = (layout.num_layers, 2, layout.block_size, layout.num_kv_heads,
                            layout.head_dim)
        self.block_bytes = kv_cache.dtype.itemsize * _numel(self.block_shape)
        self.num_offloaded = self.num_promoted = 0
        kv.pool.on_evict = self.offload

    def detach(self) -> None:
        self.kv.pool.on_evict = None

    def offload(self, block: KVBlock) -> None:
        """Pool eviction hook: the block's KV goes below before its id is reused."""
        assert block.block_hash is not None
        kv = self.kv_cache[:, :, block.block_id].contiguous().cpu()
        payload = memoryview(kv.view(torch.uint8).numpy())  # type: ignore[arg-type]
        self.tiers.offload(TieredBlock(block.block_hash, block.parent_hash, block.owner,
                                       block.hits > 0), payload)
        self.num_offloaded += 1

    def promote(self, block_hashes: Sequence[BlockHash], num_tokens: int,
                tenant: str | None) -> int:
        """Brings the blocks that continue the pool's cached prefix of a request (of
        `num_tokens` tokens whose full blocks hash to `block_hashes`) up from the tiers
        into the pool's prefix cache, as free cached blocks the request will hit. Stops at
        the first block the tiers cannot give or the pool cannot hold. Returns how many
        came up."""
        hit = self.kv.computed_prefix(block_hashes, num_tokens)
        limit = max(0, (num_tokens - 1) // self.kv.block_size)  # as computed_prefix caps
        wanted = list(block_hashes[len(hit):limit])
        if not wanted:
            return 0
        num = min(self.tiers.available(wanted, tenant), len(wanted))
        if num == 0:
            return 0
        pool = self.kv.pool
        pool.touch(hit, hit=False)  # the allocation below must not reuse the blocks this extends
        try:
            num = min(num, pool.num_free_blocks)
            block_ids = pool.allocate(num) or []
            done = 0
            for block_id, block_hash in zip(block_ids, wanted):
                if not self._fill(block_id, block_hash, tenant):
                    break
                parent = block_hashes[len(hit) + done - 1] if len(hit) + done else None
                pool.cache_block(block_id, block_hash, parent, tenant)
                done += 1
            pool.free(reversed(block_ids))  # cached and free: the request hits them next
        finally:
            pool.free(reversed(hit))
        self.num_promoted += done
        return done

    def _fill(self, block_id: int, block_hash: BlockHash, tenant: str | None) -> bool:
        payload = self.tiers.load(block_hash, tenant)
        if payload is None:
            return False
        if len(payload) != self.block_bytes:
            logger.warning("a tier returned %d bytes for a block of %d; recomputing",
                           len(payload), self.block_bytes)
            return False
        kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv_cache.dtype)
        self.kv_cache[:, :, block_id] = kv.view(self.block_shape).to(self.kv_cache.device)
        return True


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
