"""The host-memory tier: one preallocated arena cut into block-sized slots, LRU across
tenants, per-tenant quotas, secure deletion.

    arena  [num_slots * block_bytes] uint8     slot s = arena[s*block_bytes : (s+1)*block_bytes]

The arena is allocated once (numpy zeros: calloc, so untouched pages cost no memory) and
never grows, so the tier's memory is fixed by `capacity_bytes` whatever the traffic. A slot
freed by eviction, remove or purge is overwritten with zeros before the call returns and
before the slot can be reused: a tenant's bytes never outlive its block (DESIGN.md 6).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from splitserve.errors import StoreError
from splitserve.kv_cache.block_hash import BlockHash

from .block import (ALL_TENANTS, AllTenants, BlockKey, PurgeReport, PutOutcome, PutResult,
                    TierEvent, TierName, TierStats, tenant_id)
from .ledger import Entry, Ledger

logger = logging.getLogger(__name__)

# Called with an evicted block and a view of its bytes, BEFORE its slot is wiped: the view
# is valid only during the call (copy what you keep). Runs under the tier's lock.
EvictCallback = Callable[[BlockKey, memoryview], None]


def payload_view(payload: object, block_bytes: int) -> memoryview:
    """`payload` (bytes, bytearray, memoryview, numpy array: any C-contiguous buffer) as
    flat bytes; StoreError unless it is exactly one block."""
    try:
        view = memoryview(payload).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise StoreError(f"a block payload must be a C-contiguous buffer (bytes, memoryview, "
                         f"numpy array), got {type(payload).__name__}") from None
    if view.nbytes != block_bytes:
        raise StoreError(f"block payload has {view.nbytes} bytes, this store keeps blocks of "
                         f"{block_bytes}; the store's block_bytes must match the engine's KV "
                         f"layout")
    return view


class HostTier:
    """Blocks in host memory, keyed by (tenant, hash). Thread-safe."""

    def __init__(self, capacity_bytes: int, block_bytes: int,
                 tenant_quota_bytes: int | None = None,
                 quotas: Mapping[str | None, int] | None = None,
                 on_evict: EvictCallback | None = None) -> None:
        self._ledger: Ledger[int] = Ledger(TierName.HOST, capacity_bytes, block_bytes,
                                           tenant_quota_bytes, quotas)
        self.block_bytes = block_bytes
        self.num_slots = self._ledger.capacity_blocks
        self.on_evict = on_evict
        self._arena = np.zeros(self.num_slots * block_bytes, dtype=np.uint8)
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._lock = threading.Lock()

    def put(self, key: BlockKey, payload: object) -> PutResult:
        """Copies `payload` into a free slot, evicting the tenant's own LRU blocks (quota)
        and then the global LRU (capacity) when needed; each evicted block goes through
        `on_evict` before its slot is wiped."""
        view = payload_view(payload, self.block_bytes)
        start = time.perf_counter()
        with self._lock:
            stats = self._ledger.stats
            entry = self._ledger.find(key.tenant_id, key.block_hash)
            if entry is not None:
                self._ledger.touch(entry)
                stats.count_put(PutOutcome.ALREADY)
                return PutResult(PutOutcome.ALREADY)
            victims = self._ledger.plan_room(key.tenant_id)
            if not isinstance(victims, list):
                stats.count_put(PutOutcome.REFUSED, victims)
                return PutResult(PutOutcome.REFUSED, victims)
            evicted = [self._evict(victim) for victim in victims]
            slot = self._free_slots.pop()
            self._slot(slot)[:] = np.frombuffer(view, dtype=np.uint8)
            self._ledger.insert(key, slot)
            stats.count_put(PutOutcome.STORED)
            stats.bytes_written += self.block_bytes
            stats.store_seconds += time.perf_counter() - start
            return PutResult(PutOutcome.STORED, evicted=evicted)

    def get(self, block_hash: BlockHash, tenant: str | None) -> bytes | None:
        """A copy of the tenant's block, or None. Another tenant's block of the same hash
        is a miss like an absent one: same answer, same counters."""
        start = time.perf_counter()
        with self._lock:
            stats = self._ledger.stats
            entry = self._ledger.find(tenant_id(tenant), block_hash)
            if entry is None:
                stats.misses += 1
                return None
            self._ledger.touch(entry)
            data = self._slot(entry.loc).tobytes()
            stats.hits += 1
            stats.bytes_read += self.block_bytes
            stats.load_seconds += time.perf_counter() - start
            return data

    def contains(self, block_hash: BlockHash, tenant: str | None) -> bool:
        """Whether the tenant holds the block; counts nothing and keeps the LRU order."""
        with self._lock:
            return self._ledger.find(tenant_id(tenant), block_hash) is not None

    def remove(self, block_hash: BlockHash) -> bool:
        """Deletes (and wipes) every tenant's copy of the block; False if there was none."""
        with self._lock:
            entries = self._ledger.entries_with_hash(block_hash)
            for entry in entries:
                self._free(self._ledger.pop(entry.entry_id, evicted=False))
            return bool(entries)

    def purge_tenant(self, tenant: str | None) -> PurgeReport:
        """Deletes and wipes every block of the tenant."""
        with self._lock:
            entries = self._ledger.entries(tenant_id(tenant))
            for entry in entries:
                self._free(self._ledger.pop(entry.entry_id, evicted=False))
            return PurgeReport(len(entries), len(entries) * self.block_bytes)

    def hashes(self, tenant: str | None | AllTenants = ALL_TENANTS) -> list[BlockHash]:
        """Held hashes, least recently used first: every tenant's, or one tenant's."""
        with self._lock:
            selected = None if isinstance(tenant, AllTenants) else tenant_id(tenant)
            return [e.key.block_hash for e in self._ledger.entries(selected)]

    def keys(self) -> list[BlockKey]:
        """Every held block, least recently used first."""
        with self._lock:
            return [e.key for e in self._ledger.entries()]

    def stats(self) -> TierStats:
        with self._lock:
            return self._ledger.stats.copy()

    def enable_events(self, max_records: int) -> None:
        with self._lock:
            self._ledger.enable_events(max_records)

    def take_events(self) -> list[TierEvent]:
        with self._lock:
            return self._ledger.take_events()

    def arena_view(self) -> memoryview:
        """The whole arena, read-only: for audits (a test scans it for a tenant's bytes)."""
        return self._arena.data.toreadonly()

    def check_invariants(self) -> None:
        """Accounting holds, no slot is lost or shared, and every free slot is zeros
        (reads the whole free arena: for tests and shutdown checks, not the hot path)."""
        with self._lock:
            self._ledger.check_invariants()
            used = sorted(e.loc for e in self._ledger.entries())
            assert len(set(used)) == len(used), "two blocks share a slot"
            assert sorted(used + self._free_slots) == list(range(self.num_slots)), "lost slot"
            assert not any(self._slot(s).any() for s in self._free_slots), "free slot not wiped"

    def _evict(self, victim: Entry[int]) -> BlockKey:
        entry = self._ledger.pop(victim.entry_id, evicted=True)
        if self.on_evict is not None:
            view = self._slot(entry.loc).data.toreadonly()
            try:
                self.on_evict(entry.key, view)
            except Exception:  # noqa: BLE001 - a write-back failure must not break the put
                logger.exception("host tier: on_evict failed for block %s",
                                 entry.key.block_hash.hex())
            finally:
                with contextlib.suppress(BufferError):  # the callback kept a derived view
                    view.release()
        self._free(entry)
        return entry.key

    def _free(self, entry: Entry[int]) -> None:
        self._slot(entry.loc)[:] = 0  # secure deletion, before the slot can be reused
        self._free_slots.append(entry.loc)

    def _slot(self, slot: int) -> np.ndarray:
        start = slot * self.block_bytes
        return self._arena[start:start + self.block_bytes]
