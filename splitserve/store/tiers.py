"""The chain of tiers below one worker's engine pool (tier 0): host memory, then disk.

    engine pool --evict--> offload --> HostTier --evict (on_evict)--> DiskWriter --> DiskTier
                <--load--- (HOST, bytes) <------  <--promote-- (DISK, bytes) <--------

Write-back: a block enters the host tier when the engine pool evicts it, and reaches disk
only when the host tier evicts it in turn, and then only if it was reused (DESIGN.md 6:
"do not write a block to disk until it was reused"): the engine says so when offloading,
and a host hit counts as a reuse. Disk writes go through the writer's bounded queue, so
the engine thread never waits on the disk; a full queue refuses (BUSY, counted).
Tiers are inclusive: a block promoted from disk to host stays on disk, so evicting it from
host again costs no write.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from splitserve.kv_cache.block_hash import BlockHash

from .block import (BlockKey, PurgeReport, PutOutcome, PutResult, RefusalReason, TierEvent,
                    TierName, TierStats, tenant_id)
from .config import StoreConfig
from .disk import DiskTier
from .host import HostTier, payload_view
from .ledger import EntryId
from .writer import DiskWriter

DEFAULT_QUEUE_BLOCKS = 64
DEFAULT_MAX_EVENTS = 65536


class TieredStore:
    """Host and disk tiers of one worker (either may be None, not both). Thread-safe: the
    engine thread offloads and loads while an admin call purges."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None, *,
                 queue_blocks: int = DEFAULT_QUEUE_BLOCKS, promote: bool = True,
                 max_events: int = DEFAULT_MAX_EVENTS, close_timeout_s: float = 5.0,
                 lock_timeout_s: float = 10.0) -> None:
        if host is None and disk is None:
            raise ValueError("a TieredStore needs a host tier, a disk tier or both "
                             "(--kv-host-bytes, --kv-disk-dir)")
        if host is not None and disk is not None and host.block_bytes != disk.block_bytes:
            raise ValueError(f"host tier blocks of {host.block_bytes} bytes and disk tier "
                             f"blocks of {disk.block_bytes}: both must be the engine's")
        self.host = host
        self.disk = disk
        self.promote = promote
        self.close_timeout_s = close_timeout_s
        self.block_bytes = next(t.block_bytes for t in (host, disk) if t is not None)
        self._reused: set[EntryId] = set()  # host blocks hit at least once
        self._lock = threading.Lock()
        self._writer: DiskWriter | None = None
        if host is not None:
            host.on_evict = self._on_host_evict
            host.enable_events(max_events)
        if disk is not None:
            disk.enable_events(max_events)
            self._writer = DiskWriter(disk, queue_blocks, lock_timeout_s)

    def offload(self, key: BlockKey, payload: object, reused: bool) -> PutResult:
        """The engine pool evicted this block: keep it in the host tier (or, without one or
        when it refuses, queue it for disk). `reused`: the block was hit while in the pool.
        QUEUED means the disk write happens later; its outcome is in the disk's stats."""
        if self.host is not None:
            result = self.host.put(key, payload)
            if result.outcome is not PutOutcome.REFUSED:
                if reused:
                    with self._lock:
                        self._reused.add((key.tenant_id, key.block_hash))
                return result
            if self.disk is None:
                return result
        return self._to_disk(key, payload_view(payload, self.block_bytes), reused)

    def lookup(self, hashes: Sequence[BlockHash], tenant: str | None) -> list[TierName]:
        """The tier of each block of the longest prefix of `hashes` the tenant has below
        the engine pool (host before disk); counts nothing."""
        found: list[TierName] = []
        for block_hash in hashes:
            if self.host is not None and self.host.contains(block_hash, tenant):
                found.append(TierName.HOST)
            elif self.disk is not None and self.disk.contains(block_hash, tenant):
                found.append(TierName.DISK)
            else:
                break
        return found

    def load(self, block_hash: BlockHash, tenant: str | None) -> tuple[TierName, bytes] | None:
        """The tenant's block from the fastest tier holding it, or None. A hit counts as a
        reuse (the block earns its way to disk); a disk hit is promoted to host."""
        entry_id = (tenant_id(tenant), block_hash)
        if self.host is not None:
            data = self.host.get(block_hash, tenant)
            if data is not None:
                with self._lock:
                    self._reused.add(entry_id)
                return TierName.HOST, data
        if self.disk is None:
            return None
        found = self.disk.get_with_key(block_hash, tenant)
        if found is None:
            return None
        key, data = found
        if self.host is not None and self.promote:
            if self.host.put(key, data).outcome is not PutOutcome.REFUSED:
                with self._lock:
                    self._reused.add(entry_id)
        return TierName.DISK, data

    def remove(self, block_hash: BlockHash) -> dict[TierName, bool]:
        """Deletes (wipes) every copy of the block from every tier; queued writes of it
        still land (the engine removes blocks it knows are stale, a rare path)."""
        removed: dict[TierName, bool] = {}
        if self.host is not None:
            removed[TierName.HOST] = self.host.remove(block_hash)
            with self._lock:
                self._reused = {e for e in self._reused if e[1] != block_hash}
        if self.disk is not None:
            removed[TierName.DISK] = self.disk.remove(block_hash)
        return removed

    def purge_tenant(self, tenant: str | None) -> dict[TierName, PurgeReport]:
        """Deletes and wipes every block of the tenant from every tier, its queued disk
        writes included. StoreError if a disk write holds the disk past its deadline."""
        reports: dict[TierName, PurgeReport] = {}
        if self.host is not None:
            reports[TierName.HOST] = self.host.purge_tenant(tenant)
            with self._lock:
                self._reused = {e for e in self._reused if e[0] != tenant_id(tenant)}
        if self._writer is not None:
            reports[TierName.DISK] = self._writer.purge_tenant(tenant)
        return reports

    def stats(self) -> dict[TierName, TierStats]:
        tiers: list[HostTier | DiskTier | None] = [self.host, self.disk]
        return {s.tier: s for s in (t.stats() for t in tiers if t is not None)}

    def take_events(self) -> list[TierEvent]:
        """What entered and left each tier since the last call (the first call, and a call
        after a backlog overflow, gives a resync event per tier)."""
        events: list[TierEvent] = []
        for tier in (self.host, self.disk):
            if tier is not None:
                events += tier.take_events()
        return events

    def queued_writes(self) -> int:
        return self._writer.queued() if self._writer is not None else 0

    def flush(self, timeout_s: float) -> bool:
        """Waits until queued disk writes are done; False if `timeout_s` passed first."""
        return self._writer.flush(timeout_s) if self._writer is not None else True

    def close(self) -> bool:
        """Writes what is queued (within `close_timeout_s`), stops the writer and releases
        the disk directory. False if the writer did not stop in time."""
        stopped = self._writer.close(self.close_timeout_s) if self._writer is not None else True
        if self.disk is not None:
            self.disk.close()
        return stopped

    def _on_host_evict(self, key: BlockKey, payload: memoryview) -> None:
        """Write-back of a block the host tier evicts (under the host's lock)."""
        entry_id = (key.tenant_id, key.block_hash)
        with self._lock:
            reused = entry_id in self._reused
            self._reused.discard(entry_id)
        if self.disk is not None:
            self._to_disk(key, payload, reused)

    def _to_disk(self, key: BlockKey, payload: memoryview, reused: bool) -> PutResult:
        assert self.disk is not None and self._writer is not None
        if not self.disk.admits(reused):
            return self.disk.note_refusal(RefusalReason.NOT_ADMITTED)  # and never copied
        if self.disk.contains(key.block_hash, key.tenant):
            return PutResult(PutOutcome.ALREADY)  # promoted earlier: still on disk
        if self._writer.submit(key, payload, reused):
            return PutResult(PutOutcome.QUEUED)
        return self.disk.note_refusal(RefusalReason.BUSY)


def build_store(config: StoreConfig, block_bytes: int, fingerprint: str,
                master_key: bytes | None) -> TieredStore | None:
    """The store `config` asks for, or None when every tier is off. `master_key` seals
    the disk tier (required with a disk directory)."""
    config.check_block_bytes(block_bytes)
    host = HostTier(config.host_bytes, block_bytes, config.tenant_quota_bytes) \
        if config.host_bytes else None
    disk = None
    if config.disk_dir is not None:
        if master_key is None:
            raise ValueError("the KV disk tier encrypts blocks and needs a master key; "
                             "pass one (store.crypto.new_master_key() makes one)")
        disk = DiskTier(config.disk_dir, config.disk_bytes, block_bytes, fingerprint,
                        master_key, config.tenant_quota_bytes,
                        admission=config.disk_admission, fsync=config.disk_fsync)
    if host is None and disk is None:
        return None
    return TieredStore(host, disk, queue_blocks=config.disk_queue_blocks)
