"""The store as the engine sees it: `TieredStore` behind the engine's `KVTiers` interface
(engine/kv_tiers.py), counting what came up from which tier."""
from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.kv_tiers import TieredBlock
from splitserve.kv_cache import BlockHash

from .block import BlockKey, TierName
from .tiers import TieredStore


class EngineTiers:
    """Implements `KVTiers` over a worker's `TieredStore`."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.loaded: dict[TierName, int] = {tier: 0 for tier in TierName}  # blocks come up

    def offload(self, block: TieredBlock, payload: memoryview) -> None:
        self.store.offload(BlockKey(block.block_hash, block.parent_hash, block.tenant),
                           payload, block.reused)

    def available(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> int:
        return len(self.store.lookup(block_hashes, tenant))

    def load(self, block_hash: BlockHash, tenant: str | None) -> bytes | None:
        found = self.store.load(block_hash, tenant)
        if found is None:
            return None
        tier, payload = found
        self.loaded[tier] += 1
        return payload
