"""The store as the engine sees it: `TieredStore` behind the engine's `KVTiers` interface
(engine/kv_tiers.py). It loads a block only while its tier is faster than recomputing
it (store/speed.py), measuring both: each load's time, and the engine's prefill time per
token (`observe_prefill`, fed by the worker from its steps)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from splitserve.engine.kv_tiers import TieredBlock
from splitserve.kv_cache import BlockHash

from .block import BlockKey, TierName
from .speed import EWMA_WEIGHT, TierSpeeds, blocks_worth_loading
from .tiers import TieredStore

MIN_PREFILL_TOKENS = 64  # shorter prefill steps say more about overhead than per-token cost


class EngineTiers:
    """Implements `KVTiers` over a worker's `TieredStore`."""

    def __init__(self, store: TieredStore, block_size: int) -> None:
        self.store, self.block_size = store, block_size
        self.speeds = TierSpeeds()
        self.prefill_token_s: float | None = None  # measured; None: load whatever is below
        self.loaded: dict[TierName, int] = {tier: 0 for tier in TierName}  # blocks come up
        self.skipped = 0  # blocks below the pool recomputed because loading was slower

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled `num_tokens` (and decoded little) took `seconds`."""
        if num_tokens < MIN_PREFILL_TOKENS:
            return
        sample = seconds / num_tokens
        old = self.prefill_token_s
        self.prefill_token_s = sample if old is None else old + EWMA_WEIGHT * (sample - old)

    def offload(self, block: TieredBlock, payload: memoryview) -> None:
        self.store.offload(BlockKey(block.block_hash, block.parent_hash, block.tenant),
                           payload, block.reused)

    def available(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> int:
        tiers = self.store.lookup(block_hashes, tenant)
        recompute = (None if self.prefill_token_s is None
                     else self.prefill_token_s * self.block_size)
        n = blocks_worth_loading(tiers, self.speeds, self.store.block_bytes, recompute)
        self.skipped += len(tiers) - n
        return n

    def load(self, block_hash: BlockHash, tenant: str | None) -> bytes | None:
        start = time.perf_counter()
        found = self.store.load(block_hash, tenant)
        if found is None:
            return None
        tier, payload = found
        self.speeds.observe(tier, 1, time.perf_counter() - start)
        self.loaded[tier] += 1
        return payload
