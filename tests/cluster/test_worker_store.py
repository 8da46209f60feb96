"""A worker's store (cluster/worker/tiers.py): its disk directory is its own; when a live
process holds it (the worker that had this id switched roles and kept its store), the
new worker takes the first free sibling instead of failing to start."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from splitserve.cluster.worker.tiers import _build
from splitserve.store import DiskTier, StoreConfig, new_master_key

BB = 1024


def test_a_locked_disk_directory_falls_back_to_a_sibling(tmp_path: Path) -> None:
    key = new_master_key()
    engine = SimpleNamespace(tier_block_bytes=BB, fingerprint="fp")
    config = StoreConfig(disk_dir=str(tmp_path / "decode-0"), disk_bytes=8 * BB)
    first = _build(config, engine, key)  # type: ignore[arg-type]
    assert first is not None and first.disk is not None
    second = _build(config, engine, key)  # type: ignore[arg-type]
    assert second is not None and second.disk is not None
    assert second.disk.directory.parent == tmp_path / "decode-0+2"
    second.close()
    first.close()
    third = _build(config, engine, key)  # type: ignore[arg-type]  # free again: its own
    assert third is not None and third.disk is not None
    assert third.disk.directory.parent == tmp_path / "decode-0"
    third.close()
    assert isinstance(third.disk, DiskTier)


def test_a_rejoining_worker_resends_each_tier_whole(tmp_path: Path) -> None:
    """After an adoption or a role switch the router's tier index starts over: one resync
    batch per tier, with every block the tier holds, and a sequence number past the last."""
    from splitserve.cluster import protocol as P
    from splitserve.cluster.router.tiers import TierIndex
    from splitserve.cluster.worker.tiers import WorkerStore
    from splitserve.store import BlockKey, TierName

    key = new_master_key()
    config = StoreConfig(host_bytes=4 * BB, disk_dir=str(tmp_path / "both-0"),
                         disk_bytes=8 * BB, disk_admission="all")
    store = _build(config, SimpleNamespace(  # type: ignore[arg-type]
        tier_block_bytes=BB, fingerprint="fp"), key)
    assert store is not None and store.disk is not None
    engine = SimpleNamespace(block_size=16, attach_tiers=lambda tiers: SimpleNamespace(
        detach=lambda: None))
    worker_store = WorkerStore(engine, store)  # type: ignore[arg-type]
    hashes = [bytes([i]) * 16 for i in range(1, 8)]
    for i, h in enumerate(hashes):  # 7 blocks through a 4-block host: 3 go on to disk
        store.offload(BlockKey(h, hashes[i - 1] if i else None, None), bytes(BB), True)
    assert store.flush(5.0)
    first = worker_store.event_batches()
    index = TierIndex()
    for batch in first:
        index.apply("both-0", TierName(batch.tier), batch.seq, batch.events)
    again = worker_store.snapshot()
    assert {b.tier for b in again} == {"host", "disk"}
    fresh = TierIndex()  # a new frontend
    for batch in again:
        assert isinstance(batch, P.TierEventBatch) and batch.seq == 2
        fresh.apply("both-0", TierName(batch.tier), batch.seq, batch.events)
    for tier in (TierName.HOST, TierName.DISK):
        assert fresh.num_blocks("both-0", tier) == index.num_blocks("both-0", tier) > 0
    worker_store.close()
