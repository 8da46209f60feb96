"""A worker's KV store (splitserve/store/): built from its spec and the cluster's store
key, attached below the engine's pool, purged on the frontend's word, and reported
(LoadReport.tiers) for /metrics."""
from __future__ import annotations

import logging
from typing import Any

from splitserve.cluster import protocol as P
from splitserve.engine.engine import LLMEngine
from splitserve.errors import SplitserveError
from splitserve.store.block import TierStats
from splitserve.store.config import StoreConfig
from splitserve.store.engine_tiers import EngineTiers
from splitserve.store.tiers import TieredStore, build_store

logger = logging.getLogger(__name__)


class WorkerStore:
    """The tiers below one worker's pool (`build` returns None when it has none)."""

    def __init__(self, engine: LLMEngine, store: TieredStore) -> None:
        self.engine, self.store = engine, store
        self.tiers = EngineTiers(store)
        self.bridge = engine.attach_tiers(self.tiers)

    @staticmethod
    def build(engine: LLMEngine, options: dict[str, Any], key: bytes) -> WorkerStore | None:
        if not options:
            return None
        config = StoreConfig(**options)
        store = build_store(config, engine.tier_block_bytes, engine.fingerprint, key or None)
        if store is None:
            return None
        logger.info("KV store below the pool: host %d bytes, disk %s (%d bytes)",
                    config.host_bytes, config.disk_dir, config.disk_bytes)
        return WorkerStore(engine, store)

    def purge(self, tenant: str | None) -> tuple[list[P.TierCount], str | None]:
        """Deletes and wipes the tenant's blocks from every tier; what went, and an error
        naming a tier that could not finish in time (the others were purged)."""
        removed = []
        try:
            for tier, report in self.store.purge_tenant(tenant).items():
                removed.append(P.TierCount(tier.value, report.blocks, report.bytes))
        except SplitserveError as exc:
            return removed, f"{type(exc).__name__}: {exc}"
        return removed, None

    def usage(self) -> list[P.TierUsage]:
        return [_usage(stats, self.tiers.loaded[tier])
                for tier, stats in self.store.stats().items()]

    def close(self) -> None:
        self.bridge.detach()
        if not self.store.close():
            logger.warning("the KV store's disk writer did not stop in time")


def _usage(s: TierStats, hits: int) -> P.TierUsage:
    return P.TierUsage(
        s.tier.value, s.capacity_bytes, s.used_bytes, s.blocks, hits, s.misses, s.evictions,
        s.corrupt, s.bytes_read, s.bytes_written, s.load_seconds, s.store_seconds,
        [P.TierCount(r.value, n, 0) for r, n in s.refusals.items()],
        [P.TierCount(t, 0, b) for t, b in s.tenant_used_bytes.items()])

