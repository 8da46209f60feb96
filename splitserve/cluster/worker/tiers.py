"""A worker's KV store (splitserve/store/): built from its spec and the cluster's store
key, attached below the engine's pool, purged on the frontend's word, and reported
(LoadReport.tiers) for /metrics."""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from splitserve.cluster import protocol as P
from splitserve.engine.engine import LLMEngine, StepStats
from splitserve.errors import SplitserveError, StoreError
from splitserve.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.store.block import TierEvent, TierName, TierStats
from splitserve.store.config import StoreConfig
from splitserve.engine.request import Request
from splitserve.store.engine_tiers import EngineTiers
from splitserve.store.prefetch import Prefetcher
from splitserve.store.tiers import TieredStore, build_store

logger = logging.getLogger(__name__)

MAX_DISK_DIRS = 8  # <dir>/<worker id>, then <dir>/<worker id>+2 ... when one is locked


class WorkerStore:
    """The tiers below one worker's pool (`build` returns None when it has none)."""

    def __init__(self, engine: LLMEngine, store: TieredStore) -> None:
        self.engine, self.store = engine, store
        self.tiers = EngineTiers(store, engine.block_size)
        self.bridge = engine.attach_tiers(self.tiers)
        self._seq = {tier: 0 for tier in TierName}
        self.prefetcher = Prefetcher(store)

    @staticmethod
    def build(engine: LLMEngine, options: dict[str, Any], key: bytes) -> WorkerStore | None:
        if not options:
            return None
        config = StoreConfig(**options)
        store = _build(config, engine, key)
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

    def prefetch(self, req: Request) -> None:
        """Reads the request's prefix blocks that are on disk into the host tier while it
        waits for the engine (store/prefetch.py)."""
        kv = self.bridge.kv
        start = len(kv.computed_prefix(req.block_hashes, req.num_tokens))
        limit = max(0, (req.num_tokens - 1) // kv.block_size)
        self.prefetcher.submit(req.block_hashes[start:limit], req.tenant)

    def observe_step(self, step: StepStats | None) -> None:
        if step is not None and step.num_decode_seqs <= 1:
            self.tiers.observe_prefill(step.num_prefill_tokens, step.seconds)

    def event_batches(self) -> list[P.TierEventBatch]:
        """What entered and left each tier since the last call, one batch per tier."""
        by_tier: dict[TierName, list[KVEvent]] = {}
        for event in self.store.take_events():
            by_tier.setdefault(event.tier, []).extend(_kv_events(event))
        batches = []
        for tier, events in by_tier.items():
            self._seq[tier] += 1
            batches.append(P.TierEventBatch(self._seq[tier], tier.value, events))
        return batches

    def snapshot(self) -> list[P.TierEventBatch]:
        """Everything each tier holds, as resync batches (a new frontend or identity: the
        router's tier index starts over from them); pending events are folded in."""
        self.store.take_events()
        batches = []
        for tier, held in ((TierName.HOST, self.store.host), (TierName.DISK, self.store.disk)):
            if held is None:
                continue
            self._seq[tier] += 1
            batches.append(P.TierEventBatch(self._seq[tier], tier.value, _kv_events(
                TierEvent(tier, tuple(held.keys()), resync=True))))
        return batches

    def usage(self) -> list[P.TierUsage]:
        return [_usage(stats, self.tiers.loaded[tier])
                for tier, stats in self.store.stats().items()]

    def close(self) -> None:
        self.prefetcher.close()
        self.bridge.detach()
        if not self.store.close():
            logger.warning("the KV store's disk writer did not stop in time")


def _build(config: StoreConfig, engine: LLMEngine, key: bytes) -> TieredStore | None:
    """The store, in the worker's own disk directory, or (it is locked by a live process:
    the worker that had this id switched roles and kept it) the first free sibling."""
    for attempt in range(MAX_DISK_DIRS):
        try:
            return build_store(config, engine.tier_block_bytes, engine.fingerprint, key or None)
        except StoreError:
            if config.disk_dir is None or attempt == MAX_DISK_DIRS - 1:
                raise
            sibling = f"{config.disk_dir.rsplit('+', 1)[0]}+{attempt + 2}"
            logger.warning("%s is in use; this worker's disk tier goes to %s",
                           config.disk_dir, sibling)
            config = replace(config, disk_dir=sibling)
    return None


def _kv_events(event: TierEvent) -> list[KVEvent]:
    """A store event in the words of the router's index (kv_cache/events.py)."""
    out: list[KVEvent] = [AllBlocksCleared()] if event.resync else []
    out += [BlockStored((key.block_hash,), key.parent_hash) for key in event.stored]
    if event.removed:
        out.append(BlockRemoved(tuple(event.removed)))
    return out


def _usage(s: TierStats, hits: int) -> P.TierUsage:
    return P.TierUsage(
        s.tier.value, s.capacity_bytes, s.used_bytes, s.blocks, hits, s.misses, s.evictions,
        s.corrupt, s.bytes_read, s.bytes_written, s.load_seconds, s.store_seconds,
        [P.TierCount(r.value, n, 0) for r, n in s.refusals.items()],
        [P.TierCount(t, 0, b) for t, b in s.tenant_used_bytes.items()])

