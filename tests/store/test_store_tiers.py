"""TieredStore: write-back from host to disk for reused blocks, lookup and load across
tiers, promotion, purge of every tier (queued writes included), the writer's bounded
queue, the change feed, close and a warm restart; StoreConfig and build_store."""
from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.store import (BlockKey, DiskTier, HostTier, PutOutcome, RefusalReason,
                              StoreConfig, TieredStore, TierEvent, TierName, build_store,
                              new_master_key)

BB = 256
FP = "fp"
KEY = new_master_key()
WAIT_S = 10.0


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def key(i: int, tenant: str | None = "a") -> BlockKey:
    return BlockKey(h(i), h(i - 1) if i else None, tenant)


def payload() -> bytes:
    return secrets.token_bytes(BB)


def leaks(buffer: bytes, data: bytes) -> bool:
    return any(data[i:i + 32] in buffer for i in range(0, len(data), 32))


def make(tmp_path: Path, host_blocks: int = 2, disk_blocks: int = 8, **options: object
         ) -> TieredStore:
    host = HostTier(host_blocks * BB, BB)
    disk = DiskTier(tmp_path, disk_blocks * BB, BB, FP, KEY)  # admission: reused
    return TieredStore(host, disk, **options)  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = make(tmp_path)
    yield s
    s.close()


def test_write_back_to_disk_only_for_reused_blocks(store: TieredStore) -> None:
    data = {i: payload() for i in range(4)}
    assert store.offload(key(0), data[0], reused=True).outcome is PutOutcome.STORED
    store.offload(key(1), data[1], reused=False)
    store.offload(key(2), data[2], reused=False)  # host evicts 0 (reused): to disk
    store.offload(key(3), data[3], reused=False)  # host evicts 1 (never hit): dropped
    assert store.flush(WAIT_S)
    assert store.disk is not None and store.host is not None
    assert store.disk.hashes() == [h(0)]
    disk_stats = store.disk.stats()
    assert disk_stats.puts == {PutOutcome.STORED: 1, PutOutcome.REFUSED: 1}
    assert disk_stats.refusals == {RefusalReason.NOT_ADMITTED: 1}
    assert store.host.hashes() == [h(2), h(3)]
    assert store.load(h(0), "a") == (TierName.DISK, data[0])
    assert store.load(h(1), "a") is None


def test_a_host_hit_makes_a_block_reused(store: TieredStore) -> None:
    data = payload()
    store.offload(key(0), data, reused=False)
    assert store.load(h(0), "a") == (TierName.HOST, data)
    store.offload(key(1), payload(), reused=False)
    store.offload(key(2), payload(), reused=False)  # evicts 0, now reused
    assert store.flush(WAIT_S)
    assert store.lookup([h(0)], "a") == [TierName.DISK]


def test_lookup_is_the_longest_prefix_with_each_tier(store: TieredStore) -> None:
    for i in range(4):
        store.offload(key(i), payload(), reused=True)
    assert store.flush(WAIT_S)  # host: 2, 3; disk: 0, 1
    hashes = [h(i) for i in range(6)]
    assert store.lookup(hashes, "a") == [TierName.DISK, TierName.DISK, TierName.HOST,
                                         TierName.HOST]
    assert store.lookup(hashes, "b") == []
    assert store.lookup([h(2), h(9), h(3)], "a") == [TierName.HOST]
    before = store.stats()
    store.lookup(hashes, "a")
    assert store.stats() == before  # lookups count nothing


def test_disk_hit_is_promoted_and_stays_on_disk(store: TieredStore) -> None:
    data = {i: payload() for i in range(3)}
    for i in range(3):
        store.offload(key(i), data[i], reused=True)
    assert store.flush(WAIT_S)
    assert store.load(h(0), "a") == (TierName.DISK, data[0])
    assert store.host is not None and store.disk is not None
    assert store.host.hashes() == [h(2), h(0)] and h(0) in store.disk.hashes()
    assert store.load(h(0), "a") == (TierName.HOST, data[0])
    assert store.flush(WAIT_S)
    assert store.disk.stats().puts == {PutOutcome.STORED: 2}  # 0 and 1; no rewrite of 0
    assert store.load(h(0), "b") is None


def test_purge_removes_every_tier_and_queued_writes(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=2)
    assert store.disk is not None and store.host is not None and store._writer is not None
    writer = store._writer
    started, release = threading.Event(), threading.Event()
    real_write = writer._write

    def stalled_write(item: object) -> None:  # taken off the queue, not yet written
        started.set()
        release.wait(WAIT_S)
        real_write(item)  # type: ignore[arg-type]
    writer._write = stalled_write  # type: ignore[method-assign,assignment]
    a_data = [payload() for _ in range(6)]
    store.offload(key(0, "A"), a_data[0], reused=True)
    store.offload(key(1, "A"), a_data[1], reused=True)
    store.offload(key(2, "A"), a_data[2], reused=True)  # evicts 0: taken by the writer
    assert started.wait(WAIT_S)
    release.set()
    assert store.flush(WAIT_S)  # 0 written: A has one block on disk
    started.clear()
    release.clear()
    for i in range(3, 6):  # evict 1 (in flight, stalled), 2 and 3 (queued)
        store.offload(key(i, "A"), a_data[i], reused=True)
    assert started.wait(WAIT_S) and store.queued_writes() == 3
    reports = store.purge_tenant("A")
    release.set()  # the write taken before the purge must not land after it
    b_data = payload()
    for i in range(9, 12):  # B's 9 reaches disk
        store.offload(key(i, "B"), b_data if i == 9 else payload(), reused=True)
    assert store.flush(WAIT_S)
    assert (reports[TierName.HOST].blocks, reports[TierName.DISK].blocks) == (2, 1)
    assert store.host.hashes("A") == [] and store.disk.hashes("A") == []
    assert store.lookup([h(i) for i in range(6)], "A") == []
    assert store.disk.hashes("B") == [h(9)] and store.load(h(9), "B") == (TierName.DISK, b_data)
    arena = bytes(store.host.arena_view())
    assert not any(leaks(arena, data) for data in a_data)
    store.close()
    files = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert not any(leaks(files, data) for data in a_data)
    reopened = DiskTier(tmp_path, 8 * BB, BB, FP, KEY)
    # None of A's writes landed after the purge (B's later evictions did).
    assert reopened.hashes("A") == [] and h(9) in reopened.hashes("B")
    reopened.close()


def test_full_writer_queue_refuses_busy(tmp_path: Path) -> None:
    store = make(tmp_path, host_blocks=1, queue_blocks=1)
    assert store.disk is not None
    started, gate = threading.Event(), threading.Event()
    real_put = store.disk.put

    def stalled_put(*args: object, **kwargs: object) -> object:
        started.set()
        gate.wait(WAIT_S)
        return real_put(*args, **kwargs)  # type: ignore[arg-type]
    store.disk.put = stalled_put  # type: ignore[method-assign,assignment]
    store.offload(key(0), payload(), reused=True)
    store.offload(key(1), payload(), reused=True)  # evicts 0: in flight
    assert started.wait(WAIT_S)
    for i in range(2, 5):  # evicts 1 (queued), then 2 and 3: refused
        store.offload(key(i), payload(), reused=True)
    gate.set()
    assert store.flush(WAIT_S)
    stats = store.disk.stats()
    assert stats.refusals == {RefusalReason.BUSY: 2} and store.disk.hashes() == [h(0), h(1)]
    store.close()


def test_disk_only_and_host_only_stores(tmp_path: Path) -> None:
    disk_only = TieredStore(None, DiskTier(tmp_path, 4 * BB, BB, FP, KEY))
    data = payload()
    assert disk_only.offload(key(0), data, reused=True).outcome is PutOutcome.QUEUED
    assert disk_only.offload(key(1), payload(), reused=False).reason is \
        RefusalReason.NOT_ADMITTED
    assert disk_only.flush(WAIT_S)
    assert disk_only.load(h(0), "a") == (TierName.DISK, data)
    assert disk_only.close()
    host_only = TieredStore(HostTier(BB, BB), None)
    host_only.offload(key(0), data, reused=True)
    assert host_only.offload(key(1), payload(), reused=True).evicted == [key(0)]
    assert host_only.lookup([h(0), h(1)], "a") == []
    assert host_only.lookup([h(1)], "a") == [TierName.HOST]
    assert host_only.close()
    with pytest.raises(ValueError, match="host tier, a disk tier"):
        TieredStore(None, None)


def test_host_refusal_falls_through_to_disk(tmp_path: Path) -> None:
    host = HostTier(4 * BB, BB, quotas={"tiny": 1})
    store = TieredStore(host, DiskTier(tmp_path, 4 * BB, BB, FP, KEY))
    assert store.offload(key(0, "tiny"), payload(), reused=True).outcome is PutOutcome.QUEUED
    assert store.flush(WAIT_S) and store.lookup([h(0)], "tiny") == [TierName.DISK]
    store.close()


def test_events_of_both_tiers(store: TieredStore) -> None:
    assert store.take_events() == [TierEvent(TierName.HOST, resync=True),
                                   TierEvent(TierName.DISK, resync=True)]
    for i in range(3):
        store.offload(key(i), payload(), reused=True)
    assert store.flush(WAIT_S)
    assert store.take_events() == [
        TierEvent(TierName.HOST, stored=(key(0), key(1))),
        TierEvent(TierName.HOST, removed=(h(0),)),
        TierEvent(TierName.HOST, stored=(key(2),)),
        TierEvent(TierName.DISK, stored=(key(0),)),
    ]


def test_close_writes_the_queue_and_a_restart_is_warm(tmp_path: Path) -> None:
    config = StoreConfig(host_bytes=2 * BB, disk_dir=str(tmp_path), disk_bytes=8 * BB,
                         disk_admission="all")
    store = build_store(config, BB, FP, KEY)
    assert store is not None
    data = {i: payload() for i in range(4)}
    for i in range(4):
        store.offload(key(i), data[i], reused=False)
    assert store.close()  # 0 and 1 were queued: written before close returns
    warm = build_store(config, BB, FP, KEY)
    assert warm is not None
    assert warm.lookup([h(0), h(1), h(2)], "a") == [TierName.DISK, TierName.DISK]
    assert warm.load(h(1), "a") == (TierName.DISK, data[1])
    warm.close()


def test_store_config_validation() -> None:
    assert not StoreConfig().enabled and StoreConfig(host_bytes=1).enabled
    assert build_store(StoreConfig(), BB, FP, None) is None
    bad = [
        (dict(host_bytes=-1), "host_bytes"),
        (dict(disk_dir="/tmp/x"), "needs --kv-disk-bytes"),
        (dict(disk_bytes=10), "without --kv-disk-dir"),
        (dict(disk_dir=" ", disk_bytes=10), "must name a directory"),
        (dict(disk_dir="/x", disk_bytes=10, disk_admission="often"), "admission"),
        (dict(tenant_quota_bytes=0), "tenant_quota_bytes"),
        (dict(disk_queue_blocks=0), "at least one block"),
        (dict(host_bytes=True), "host_bytes"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            StoreConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smaller than one KV block"):
        StoreConfig(host_bytes=BB - 1).check_block_bytes(BB)
    with pytest.raises(ValueError, match="master key"):
        build_store(StoreConfig(disk_dir="/tmp/x", disk_bytes=BB), BB, FP, None)
