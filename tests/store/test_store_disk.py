"""DiskTier: encrypted files, admission, LRU, quotas, tenant isolation, corrupt and foreign
files, secure deletion on disk, restart rebuild."""
from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.errors import StoreError
from splitserve.store import (BlockKey, DiskTier, PurgeReport, PutOutcome, RefusalReason,
                              TierEvent, TierName, new_master_key)

BB = 512
FP = "fingerprint-A"
KEY = new_master_key()


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def key(i: int, tenant: str | None = "a", parent: int | None = None) -> BlockKey:
    return BlockKey(h(i), None if parent is None else h(parent), tenant)


def payload() -> bytes:
    return secrets.token_bytes(BB)


def leaks(buffer: bytes, data: bytes) -> bool:
    return any(data[i:i + 32] in buffer for i in range(0, len(data), 32))


def all_file_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    yield tier
    tier.close()


def block_file(tier: DiskTier, i: int, tenant: str | None = "a") -> Path:
    path = tier.path_of(h(i), tenant)
    assert path is not None and path.exists()
    return path


def test_round_trip_encrypted_and_no_names_in_clear(disk: DiskTier, tmp_path: Path) -> None:
    data = payload()
    tenant = "tenant-with-a-secret-name"
    assert disk.put(key(1, tenant, parent=0), data).outcome is PutOutcome.STORED
    assert disk.get(h(1), tenant) == data
    assert disk.directory.parent == tmp_path and len(disk.directory.name) == 16
    stored = all_file_bytes(tmp_path)
    assert not leaks(stored, data) and tenant.encode() not in stored
    assert all(tenant not in p.name for p in tmp_path.rglob("*"))
    assert oct(block_file(disk, 1, tenant).stat().st_mode & 0o777) == "0o600"
    disk.check_invariants()


def test_admission_reused_only(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY)  # admission "reused", the default
    result = tier.put(key(1), payload())
    assert (result.outcome, result.reason) == (PutOutcome.REFUSED, RefusalReason.NOT_ADMITTED)
    assert tier.put(key(1), payload(), reused=True).outcome is PutOutcome.STORED
    assert tier.put(key(1), payload()).outcome is PutOutcome.ALREADY  # held: no admission
    assert tier.stats().refusals == {RefusalReason.NOT_ADMITTED: 1}
    assert list(tier.directory.glob("*.kvb")) == [block_file(tier, 1)]
    tier.close()


def test_lru_quota_and_capacity(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, tenant_quota_bytes=2 * BB,
                    quotas={"tiny": BB // 2}, admission="all")
    for i in range(3):
        tier.put(key(i, "a"), payload())
    assert tier.hashes("a") == [h(1), h(2)]  # quota: a's oldest went
    tier.get(h(1), "a")  # 1 is now more recent than 2
    tier.put(key(10, "b"), payload())
    result = tier.put(key(11, "b"), payload())
    assert tier.hashes() == [h(2), h(1), h(10), h(11)] and result.evicted == []
    result = tier.put(key(12, "c"), payload())
    assert result.evicted == [key(2, "a")]  # capacity: the global LRU
    assert tier.put(key(5, "tiny"), payload()).reason is RefusalReason.QUOTA
    stats = tier.stats()
    assert stats.tenant_used_bytes == {"a": BB, "b": 2 * BB, "c": BB}
    assert (stats.evictions, stats.refusals) == (2, {RefusalReason.QUOTA: 1})
    assert len(list(tier.directory.glob("*.kvb"))) == 4
    tier.check_invariants()
    tier.close()


def test_other_tenant_never_gets_the_block(disk: DiskTier) -> None:
    secret = payload()
    disk.put(key(7, "A"), secret)
    assert disk.get(h(7), "B") is None and not disk.contains(h(7), "B")
    assert disk.get(h(99), "B") is None
    stats = disk.stats()
    assert (stats.misses, stats.hits, stats.corrupt) == (2, 0, 0)
    # Even B's file under A's name (the file system is not trusted) does not open for A.
    mine = payload()
    disk.put(key(7, "B"), mine)
    a_file, b_file = disk.path_of(h(7), "A"), disk.path_of(h(7), "B")
    assert a_file is not None and b_file is not None and a_file != b_file
    shutil.copyfile(b_file, a_file)
    assert disk.get(h(7), "A") is None and disk.stats().corrupt == 1
    assert disk.get(h(7), "B") == mine


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def _flip_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[45] ^= 0x80  # inside the parent hash: authenticated as associated data
    path.write_bytes(raw)


@pytest.mark.parametrize("damage", [_flip, _truncate, _flip_header])
def test_damaged_file_is_a_corrupt_miss_and_removed(disk: DiskTier, damage: object) -> None:
    disk.put(key(1, parent=0), payload())
    path = block_file(disk, 1)
    damage(path)  # type: ignore[operator]
    assert disk.get(h(1), "a") is None
    stats = disk.stats()
    assert (stats.corrupt, stats.misses, stats.hits, stats.blocks) == (1, 1, 0, 0)
    assert not path.exists() and list(disk.directory.iterdir()) == [disk.directory / ".lock"]
    disk.check_invariants()


def test_file_copied_under_another_hash_is_corrupt(disk: DiskTier) -> None:
    disk.put(key(1), payload())
    disk.put(key(2), payload())
    shutil.copyfile(block_file(disk, 1), block_file(disk, 2))
    assert disk.get(h(2), "a") is None and disk.stats().corrupt == 1
    assert disk.get(h(1), "a") is not None


def test_file_of_another_fingerprint_is_corrupt(tmp_path: Path) -> None:
    ours = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    theirs = DiskTier(tmp_path, 4 * BB, BB, "fingerprint-B", KEY, admission="all")
    assert ours.directory != theirs.directory
    ours.put(key(1), payload())
    theirs.put(key(1), payload())
    shutil.copyfile(block_file(theirs, 1), block_file(ours, 1))
    assert ours.get(h(1), "a") is None and ours.stats().corrupt == 1
    # At restart too: a foreign file dropped into our directory is not indexed.
    theirs.put(key(2), payload())
    shutil.copy(block_file(theirs, 2), ours.directory)
    ours.close()
    reopened = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    assert reopened.hashes() == [] and reopened.stats().corrupt == 1
    assert list(reopened.directory.glob("*.kvb")) == []
    reopened.close()
    theirs.close()


def test_restart_rebuilds_the_index_and_serves_the_same_bytes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, tenant_quota_bytes=3 * BB, admission="all")
    blocks = {i: payload() for i in range(4)}
    tier.put(key(0, None), blocks[0])
    for i in range(1, 4):
        tier.put(key(i, "A", parent=i - 1), blocks[i])
    tier.get(h(1), "A")  # LRU: 0, 2, 3, 1
    before = tier.keys()
    tier.close()
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, tenant_quota_bytes=3 * BB, admission="all")
    assert tier.keys() == before
    assert [key.block_hash for key in before] == [h(0), h(2), h(3), h(1)]
    assert tier.get(h(0), None) == blocks[0]
    assert [tier.get(h(i), "A") for i in range(1, 4)] == [blocks[1], blocks[2], blocks[3]]
    assert tier.stats().tenant_used_bytes == {"": BB, "A": 3 * BB}
    # The rebuilt quota holds: A's next block evicts A's oldest.
    assert tier.put(key(4, "A"), payload()).evicted == [key(1, "A", parent=0)]
    assert tier.take_events() == []  # no feed until enabled
    tier.enable_events(100)
    assert tier.take_events() == [TierEvent(TierName.DISK, stored=tuple(tier.keys()),
                                            resync=True)]
    tier.check_invariants()
    tier.close()


def test_restart_with_another_master_key_serves_nothing(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    data = payload()
    tier.put(key(1), data)
    tier.put(key(2, "B"), payload())
    tier.close()
    other = DiskTier(tmp_path, 4 * BB, BB, FP, new_master_key(), admission="all")
    assert other.get(h(1), "a") is None and other.hashes() == []
    assert other.stats().corrupt == 2  # unreadable: dropped and wiped at rebuild
    assert list(other.directory.glob("*.kvb")) == []
    other.close()
    again = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    assert again.get(h(1), "a") is None  # the wipe was for good
    again.close()


def test_restart_wipes_leftover_temp_files_and_honours_a_smaller_capacity(
        tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="all")
    for i in range(4):
        tier.put(key(i), payload())
    (tier.directory / ".tmp-0123").write_bytes(b"half a write")
    tier.close()
    small = DiskTier(tmp_path, 2 * BB, BB, FP, KEY, admission="all")
    assert small.hashes() == [h(2), h(3)] and small.stats().evictions == 2
    assert sorted(p.name for p in small.directory.iterdir() if not p.name.endswith(".kvb")) \
        == [".lock"]
    small.check_invariants()
    small.close()


def test_secure_deletion_overwrites_the_file_in_place(disk: DiskTier) -> None:
    for i in range(3):
        disk.put(key(i, "A"), payload())
    disk.put(key(9, "B"), payload())
    # Open descriptors keep the inodes: after deletion they must read back zeros only.
    handles = {i: open(block_file(disk, i, "A"), "rb") for i in range(3)}
    sizes = {i: os.fstat(f.fileno()).st_size for i, f in handles.items()}
    assert disk.remove(h(0))
    assert disk.purge_tenant("A") == PurgeReport(blocks=2, bytes=2 * BB)
    for i, f in handles.items():
        assert f.read() == bytes(sizes[i]), f"block {i}'s file was unlinked, not wiped"
        f.close()
    # Eviction wipes too.
    handle = open(block_file(disk, 9, "B"), "rb")
    for i in range(20, 24):
        disk.put(key(i, "C"), payload())
    assert handle.read() == bytes(os.fstat(handle.fileno()).st_size)
    handle.close()
    assert disk.hashes("A") == [] and disk.hashes("B") == []
    stats = disk.stats()
    assert (stats.removals, stats.evictions) == (3, 1)
    disk.check_invariants()


def test_one_tier_per_directory(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 4 * BB, BB, FP, KEY)
    with pytest.raises(StoreError, match="own --kv-disk-dir"):
        DiskTier(tmp_path, 4 * BB, BB, FP, KEY, lock_timeout_s=0.1)
    first.close()
    assert first.put(key(1), payload(), reused=True).reason is RefusalReason.BUSY
    assert first.get(h(1), "a") is None
    DiskTier(tmp_path, 4 * BB, BB, FP, KEY).close()


def test_unusable_directory_and_bad_arguments(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(StoreError, match="writable --kv-disk-dir"):
        DiskTier(blocker, 4 * BB, BB, FP, KEY)
    with pytest.raises(ValueError, match="master key"):
        DiskTier(tmp_path, 4 * BB, BB, FP, b"short")
    with pytest.raises(ValueError, match="admission"):
        DiskTier(tmp_path, 4 * BB, BB, FP, KEY, admission="sometimes")


def test_write_failure_is_refused_and_counted(disk: DiskTier,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def disk_full(fd: int, data: object) -> int:
        real_write(fd, memoryview(data)[:10])  # type: ignore[arg-type]
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "write", disk_full)
    result = disk.put(key(1), payload())
    monkeypatch.undo()
    assert result.reason is RefusalReason.IO_ERROR and disk.hashes() == []
    assert disk.stats().refusals == {RefusalReason.IO_ERROR: 1}
    assert list(disk.directory.iterdir()) == [disk.directory / ".lock"]  # no half file
    assert disk.put(key(1), payload()).outcome is PutOutcome.STORED
