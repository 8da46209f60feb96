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
    third = _build(config, engine, key)  # free again: the worker's own directory
    assert third is not None and third.disk is not None
    assert third.disk.directory.parent == tmp_path / "decode-0"
    third.close()
    assert isinstance(third.disk, DiskTier)
