"""The bookkeeping one tier needs whatever holds its bytes: LRU order across tenants, bytes
per tenant, quotas, the choice of victims that make room, counters and the change feed.

HostTier (slots in one arena) and DiskTier (one file per block) keep their blocks' bytes;
the ledger decides which block goes and keeps the numbers, so both tiers account the same
way and a property test of one ledger rule holds for both.

    _lru        (tenant, hash) -> Entry, least recently used first (all tenants)
    _by_tenant  tenant -> its hashes in the same LRU order (quota victims come from here)
    _copies     hash -> how many tenants hold it (a hash leaves the feed at 0)
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import islice
from typing import Generic, TypeVar

from splitserve.kv_cache.block_hash import BlockHash

from .block import (BlockKey, RefusalReason, TierEvent, TierName, TierStats,
                    tenant_id)

Loc = TypeVar("Loc")  # where the tier keeps the bytes: an arena slot, a file name
EntryId = tuple[str, BlockHash]  # (tenant id, block hash)


@dataclass(slots=True)
class Entry(Generic[Loc]):
    key: BlockKey
    loc: Loc

    @property
    def entry_id(self) -> EntryId:
        return (self.key.tenant_id, self.key.block_hash)


class Ledger(Generic[Loc]):
    """Accounting of one tier; not thread-safe (the tier holds its lock around it)."""

    def __init__(self, tier: TierName, capacity_bytes: int, block_bytes: int,
                 tenant_quota_bytes: int | None = None,
                 quotas: Mapping[str | None, int] | None = None) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes={block_bytes} must be positive (the bytes of one "
                             f"engine block: layers x 2 x block_size x kv_heads x head_dim "
                             f"x dtype)")
        if capacity_bytes < 0:
            raise ValueError(f"{tier.value} tier capacity_bytes={capacity_bytes} must be >= 0")
        for name, quota in [("tenant_quota_bytes", tenant_quota_bytes),
                            *((f"quota of tenant {t!r}", q) for t, q in (quotas or {}).items())]:
            if quota is not None and quota < 0:
                raise ValueError(f"{name}={quota} must be >= 0 bytes (None: no quota)")
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self.default_quota = tenant_quota_bytes
        self.quotas = {tenant_id(t): q for t, q in (quotas or {}).items()}
        self.stats = TierStats(tier, self.capacity_blocks * block_bytes, block_bytes)
        self._lru: OrderedDict[EntryId, Entry[Loc]] = OrderedDict()
        self._by_tenant: dict[str, OrderedDict[BlockHash, None]] = {}
        self._copies: dict[BlockHash, int] = {}
        self._events: TierEventLog | None = None

    def __len__(self) -> int:
        return len(self._lru)

    def quota_bytes(self, tenant: str) -> int | None:
        return self.quotas.get(tenant, self.default_quota)

    def find(self, tenant: str, block_hash: BlockHash) -> Entry[Loc] | None:
        return self._lru.get((tenant, block_hash))

    def touch(self, entry: Entry[Loc]) -> None:
        self._lru.move_to_end(entry.entry_id)
        self._by_tenant[entry.key.tenant_id].move_to_end(entry.key.block_hash)

    def plan_room(self, tenant: str) -> list[Entry[Loc]] | RefusalReason:
        """The entries to evict, oldest first, so that one more block of `tenant` fits its
        quota and the capacity; or why it can never fit. Changes nothing."""
        if self.capacity_blocks == 0:
            return RefusalReason.TOO_BIG
        victims: list[Entry[Loc]] = []
        quota = self.quota_bytes(tenant)
        if quota is not None:
            max_blocks = quota // self.block_bytes
            if max_blocks == 0:
                return RefusalReason.QUOTA
            own = self._by_tenant.get(tenant, OrderedDict())
            excess = len(own) + 1 - max_blocks
            victims = [self._lru[(tenant, h)] for h in islice(own, max(excess, 0))]
        need = len(self._lru) - len(victims) + 1 - self.capacity_blocks
        if need > 0:
            chosen = {v.entry_id for v in victims}
            others = (e for eid, e in self._lru.items() if eid not in chosen)
            victims.extend(islice(others, need))
        return victims

    def insert(self, key: BlockKey, loc: Loc) -> Entry[Loc]:
        entry = Entry(key, loc)
        assert entry.entry_id not in self._lru, "insert of a block the tier holds"
        self._lru[entry.entry_id] = entry
        self._by_tenant.setdefault(key.tenant_id, OrderedDict())[key.block_hash] = None
        self._copies[key.block_hash] = self._copies.get(key.block_hash, 0) + 1
        self._add_usage(key.tenant_id, self.block_bytes)
        if self._events is not None:
            self._events.stored(key)
        return entry

    def pop(self, entry_id: EntryId, evicted: bool) -> Entry[Loc]:
        """Forgets a block; counted as an eviction or a removal."""
        entry = self._lru.pop(entry_id)
        tenant, block_hash = entry_id
        own = self._by_tenant[tenant]
        del own[block_hash]
        if not own:
            del self._by_tenant[tenant]
        self._copies[block_hash] -= 1
        if self._copies[block_hash] == 0:
            del self._copies[block_hash]
            if self._events is not None:
                self._events.removed(block_hash)
        self._add_usage(tenant, -self.block_bytes)
        if evicted:
            self.stats.evictions += 1
        else:
            self.stats.removals += 1
        return entry

    def entries(self, tenant: str | None = None) -> list[Entry[Loc]]:
        """Every entry (`tenant` None) or one tenant's, least recently used first."""
        if tenant is None:
            return list(self._lru.values())
        return [self._lru[(tenant, h)] for h in self._by_tenant.get(tenant, ())]

    def entries_with_hash(self, block_hash: BlockHash) -> list[Entry[Loc]]:
        if block_hash not in self._copies:
            return []
        return [e for e in self._lru.values() if e.key.block_hash == block_hash]

    def _add_usage(self, tenant: str, delta: int) -> None:
        used = self.stats.tenant_used_bytes.get(tenant, 0) + delta
        if used:
            self.stats.tenant_used_bytes[tenant] = used
        else:
            # NOTE: dropped at zero so rotating tenant names leave nothing behind.
            self.stats.tenant_used_bytes.pop(tenant, None)
        self.stats.used_bytes += delta
        self.stats.blocks = len(self._lru)

    def enable_events(self, max_records: int) -> None:
        """Start the change feed; the first take is a resync with the whole content."""
        self._events = TierEventLog(self.stats.tier, max_records)

    def take_events(self) -> list[TierEvent]:
        if self._events is None:
            return []
        return self._events.take(lambda: [e.key for e in self._lru.values()])

    def check_invariants(self) -> None:
        """Accounting matches the entries; capacity and quotas hold."""
        stats, bb = self.stats, self.block_bytes
        assert stats.blocks == len(self._lru) <= self.capacity_blocks, "over capacity"
        assert stats.used_bytes == len(self._lru) * bb, "used bytes != blocks x block bytes"
        per_tenant: dict[str, int] = {}
        for tenant, block_hash in self._lru:
            per_tenant[tenant] = per_tenant.get(tenant, 0) + bb
            assert block_hash in self._by_tenant[tenant]
        assert per_tenant == stats.tenant_used_bytes, "per-tenant usage drifted"
        assert {t: len(hs) * bb for t, hs in self._by_tenant.items()} == per_tenant
        for tenant, used in per_tenant.items():
            quota = self.quota_bytes(tenant)
            assert quota is None or used <= quota, f"tenant {tenant!r} over its quota"
        assert sum(self._copies.values()) == len(self._lru)


class TierEventLog:
    """What entered and left one tier since the last take, at most `max_records` changes;
    beyond that the backlog is dropped and the next take is a resync (the whole content),
    as kv_cache/events.py does for the engine pool."""

    def __init__(self, tier: TierName, max_records: int) -> None:
        if max_records <= 0:
            raise ValueError(f"max_records={max_records} must be positive")
        self.tier = tier
        self.max_records = max_records
        self.resync = True  # the consumer knows nothing yet
        self._records: list[BlockKey | BlockHash] = []  # BlockKey: stored; hash: removed

    def stored(self, key: BlockKey) -> None:
        self._record(key)

    def removed(self, block_hash: BlockHash) -> None:
        self._record(block_hash)

    def _record(self, record: BlockKey | BlockHash) -> None:
        if self.resync:
            return  # the resync sends the content as of the take anyway
        self._records.append(record)
        if len(self._records) > self.max_records:
            self._records, self.resync = [], True

    def take(self, content: Callable[[], list[BlockKey]]) -> list[TierEvent]:
        """The backlog as events, runs of one kind merged; `content` gives a resync."""
        if self.resync:
            self.resync = False
            return [TierEvent(self.tier, stored=tuple(content()), resync=True)]
        events: list[TierEvent] = []
        run: list[BlockKey | BlockHash] = []
        for record in self._records:
            if run and isinstance(record, BlockKey) != isinstance(run[0], BlockKey):
                events.append(self._event(run))
                run = []
            run.append(record)
        if run:
            events.append(self._event(run))
        self._records = []
        return events

    def _event(self, run: list[BlockKey | BlockHash]) -> TierEvent:
        if isinstance(run[0], BlockKey):
            return TierEvent(self.tier, stored=tuple(r for r in run if isinstance(r, BlockKey)))
        return TierEvent(self.tier, removed=tuple(r for r in run if isinstance(r, bytes)))
