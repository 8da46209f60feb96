"""The local-disk tier: one encrypted file per block, LRU across tenants, per-tenant quotas,
admission by reuse, secure deletion, and an index rebuilt from the files on restart.

    <directory>/<16 hex: BLAKE2b(fingerprint)>/<block hash hex>-<tenant tag hex>.kvb

    file = header (blockfile.py) || name box || AES-GCM(tenant key; payload; aad=header||box)

The header and name box are authenticated with the payload (and the name box on its own,
so a restart can index a file from its head alone); a file that is corrupted, truncated,
renamed, from another model or sealed under another key fails a check and is a miss: it is
counted as corrupt and securely removed, never returned.

Restart: a new DiskTier on the same directory and master key indexes the files' headers
(LRU order = mtime, which every write and hit sets from a strictly increasing clock), so a
restarted worker starts warm. Files that fail the checks, those of another master key
included, are dropped and wiped: they can never be read with this key and would otherwise
hold disk space outside the tier's capacity.

Locking: one lock guards the index; file I/O and AES run outside it, except the rename
that publishes a file, so a slow write never blocks a read. An evicted file is renamed to
a private name under the lock, then zeroed, flushed to the device and unlinked outside it.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from splitserve.errors import StoreError
from splitserve.kv_cache.block_hash import BlockHash

from .block import (ALL_TENANTS, AllTenants, BlockKey, DiskAdmission, PurgeReport, PutOutcome,
                    PutResult, RefusalReason, TierEvent, TierName, TierStats, tenant_id)
from . import blockfile
from .crypto import DiskCrypto
from .host import payload_view
from .ledger import Entry, Ledger

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_TEMP_PREFIX = ".tmp-"
_DOOMED_PREFIX = ".del-"
_LOCK_NAME = ".lock"


class DiskTier:
    """Blocks in files under `directory`, keyed by (tenant, hash). Thread-safe; one
    DiskTier per directory (a lock file enforces it, across processes too)."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 block_bytes: int, fingerprint: str, master_key: bytes,
                 tenant_quota_bytes: int | None = None,
                 quotas: Mapping[str | None, int] | None = None,
                 admission: str = DiskAdmission.REUSED, fsync: bool = False,
                 lock_timeout_s: float = 5.0) -> None:
        self._ledger: Ledger[str] = Ledger(TierName.DISK, capacity_bytes, block_bytes,
                                           tenant_quota_bytes, quotas)
        try:
            self.admission = DiskAdmission(admission)
        except ValueError:
            raise ValueError(f"disk admission {admission!r} is not one of "
                             f"{[a.value for a in DiskAdmission]}") from None
        self.block_bytes = block_bytes
        self.fsync = fsync
        self._crypto = DiskCrypto(master_key)
        self._fp_digest = blockfile.fingerprint_digest(fingerprint)
        self.directory = Path(directory) / self._fp_digest[:8].hex()
        self._lock = threading.Lock()
        self._last_stamp = 0
        self._closed = False
        self._lock_fd = self._open_directory(lock_timeout_s)
        self._rebuild()

    # --- the tier interface -------------------------------------------------------------

    def admits(self, reused: bool) -> bool:
        """Whether the admission policy takes a block (callers skip copying one it won't)."""
        return reused or self.admission is DiskAdmission.ALL

    def put(self, key: BlockKey, payload: object, reused: bool = False) -> PutResult:
        """Seals and writes the block (atomically: temp file, then rename), evicting the
        tenant's own LRU files (quota), then the global LRU (capacity) when needed."""
        view = payload_view(payload, self.block_bytes)
        tenant = key.tenant_id
        with self._lock:
            early = self._precheck(key, reused)
            if early is not None:
                return early
        start = time.perf_counter()
        temp = self.directory / f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            blockfile.write_file(temp,
                                 blockfile.seal_block(self._crypto, self._fp_digest, key, view),
                                 self.fsync)
        except OSError as exc:
            logger.warning("disk tier: writing block %s failed (%s); not kept",
                           key.block_hash.hex(), exc)
            blockfile.wipe_file(temp)
            return self.note_refusal(RefusalReason.IO_ERROR)
        doomed: list[Path] = [temp]
        try:
            with self._lock:
                early = self._precheck(key, reused)  # the index may have moved meanwhile
                if early is not None:
                    return early
                victims = self._ledger.plan_room(tenant)
                assert isinstance(victims, list), "plan_room refused after precheck"
                evicted = [v.key for v in victims]
                doomed += [self._doom(self._ledger.pop(v.entry_id, evicted=True))
                           for v in victims]
                name = self._file_name(key.block_hash, self._crypto.tenant_tag(tenant))
                try:
                    os.replace(temp, self.directory / name)
                except OSError as exc:
                    logger.warning("disk tier: publishing block %s failed (%s)",
                                   key.block_hash.hex(), exc)
                    self._ledger.stats.count_put(PutOutcome.REFUSED, RefusalReason.IO_ERROR)
                    return PutResult(PutOutcome.REFUSED, RefusalReason.IO_ERROR, evicted)
                doomed.remove(temp)
                self._stamp(name)
                self._ledger.insert(key, name)
                stats = self._ledger.stats
                stats.count_put(PutOutcome.STORED)
                stats.bytes_written += self.block_bytes
                stats.store_seconds += time.perf_counter() - start
                return PutResult(PutOutcome.STORED, evicted=evicted)
        finally:
            for path in doomed:
                blockfile.wipe_file(path)

    def get(self, block_hash: BlockHash, tenant: str | None) -> bytes | None:
        """The tenant's block, read and authenticated, or None (absent, another tenant's,
        or failing a check: then counted corrupt and wiped)."""
        found = self.get_with_key(block_hash, tenant)
        return None if found is None else found[1]

    def get_with_key(self, block_hash: BlockHash,
                     tenant: str | None) -> tuple[BlockKey, bytes] | None:
        """`get`, with the block's key (its parent hash: to promote it to another tier)."""
        start = time.perf_counter()
        tenant = tenant_id(tenant)
        with self._lock:
            entry = None if self._closed else self._ledger.find(tenant, block_hash)
            if entry is None:
                self._ledger.stats.misses += 1
                return None
        try:
            data = (self.directory / entry.loc).read_bytes()
        except FileNotFoundError:
            data = None  # evicted meanwhile, or deleted behind our back (checked below)
        payload = None
        if data is not None:
            payload = blockfile.open_block(data, self._crypto, self._fp_digest, entry.key,
                                     self._crypto.tenant_tag(tenant), self.block_bytes)
        with self._lock:
            stats = self._ledger.stats
            current = self._ledger.find(tenant, block_hash) is entry
            if payload is None:
                stats.misses += 1
                if not current:
                    return None  # evicted or replaced while we read: a plain miss
                stats.corrupt += 1
                self._ledger.pop(entry.entry_id, evicted=False)
                bad = self._doom(entry)
            else:
                if current:
                    self._ledger.touch(entry)
                    self._stamp(entry.loc)
                stats.hits += 1
                stats.bytes_read += self.block_bytes
                stats.load_seconds += time.perf_counter() - start
                return entry.key, payload
        logger.warning("disk tier: block file %s failed its checks; removed", entry.loc)
        blockfile.wipe_file(bad)
        return None

    def contains(self, block_hash: BlockHash, tenant: str | None) -> bool:
        """Whether the tenant holds the block; counts nothing and keeps the LRU order."""
        with self._lock:
            return self._ledger.find(tenant_id(tenant), block_hash) is not None

    def remove(self, block_hash: BlockHash) -> bool:
        """Deletes (wipes) every tenant's copy of the block; False if there was none."""
        with self._lock:
            entries = self._ledger.entries_with_hash(block_hash)
            doomed = [self._doom(self._ledger.pop(e.entry_id, evicted=False)) for e in entries]
        for path in doomed:
            blockfile.wipe_file(path)
        return bool(entries)

    def purge_tenant(self, tenant: str | None) -> PurgeReport:
        """Deletes and wipes every file of the tenant."""
        with self._lock:
            entries = self._ledger.entries(tenant_id(tenant))
            doomed = [self._doom(self._ledger.pop(e.entry_id, evicted=False)) for e in entries]
        for path in doomed:
            blockfile.wipe_file(path)
        return PurgeReport(len(entries), len(entries) * self.block_bytes)

    def hashes(self, tenant: str | None | AllTenants = ALL_TENANTS) -> list[BlockHash]:
        """Held hashes, least recently used first: every tenant's, or one tenant's."""
        with self._lock:
            selected = None if isinstance(tenant, AllTenants) else tenant_id(tenant)
            return [e.key.block_hash for e in self._ledger.entries(selected)]

    def path_of(self, block_hash: BlockHash, tenant: str | None) -> Path | None:
        """The tenant's file of the block, if indexed (for audits and tests)."""
        with self._lock:
            entry = self._ledger.find(tenant_id(tenant), block_hash)
            return None if entry is None else self.directory / entry.loc

    def keys(self) -> list[BlockKey]:
        with self._lock:
            return [e.key for e in self._ledger.entries()]

    def stats(self) -> TierStats:
        with self._lock:
            return self._ledger.stats.copy()

    def note_refusal(self, reason: RefusalReason) -> PutResult:
        """Counts a put refused before it reached the tier (the store's writer queue was
        full, or the block was not admitted and never copied)."""
        with self._lock:
            self._ledger.stats.count_put(PutOutcome.REFUSED, reason)
        return PutResult(PutOutcome.REFUSED, reason)

    def enable_events(self, max_records: int) -> None:
        with self._lock:
            self._ledger.enable_events(max_records)

    def take_events(self) -> list[TierEvent]:
        with self._lock:
            return self._ledger.take_events()

    def check_invariants(self) -> None:
        with self._lock:
            self._ledger.check_invariants()
            names = {e.loc for e in self._ledger.entries()}
            on_disk = {p.name for p in self.directory.glob(f"*{SUFFIX}")}
            assert names == on_disk, f"index and files differ: {sorted(names ^ on_disk)}"

    def close(self) -> None:
        """Releases the directory (its files stay for the next DiskTier). Afterwards gets
        miss and puts are refused (BUSY)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._lock_fd)

    # --- files --------------------------------------------------------------------------

    def _precheck(self, key: BlockKey, reused: bool) -> PutResult | None:
        """The outcome of a put decided without writing (under the lock), or None."""
        stats = self._ledger.stats
        if self._closed:
            stats.count_put(PutOutcome.REFUSED, RefusalReason.BUSY)
            return PutResult(PutOutcome.REFUSED, RefusalReason.BUSY)
        entry = self._ledger.find(key.tenant_id, key.block_hash)
        if entry is not None:
            self._ledger.touch(entry)
            self._stamp(entry.loc)
            stats.count_put(PutOutcome.ALREADY)
            return PutResult(PutOutcome.ALREADY)
        # NOTE: admission first: a block the policy does not take never meets the quota.
        reason = (RefusalReason.NOT_ADMITTED if not self.admits(reused)
                  else self._ledger.plan_room(key.tenant_id))
        if isinstance(reason, RefusalReason):
            stats.count_put(PutOutcome.REFUSED, reason)
            return PutResult(PutOutcome.REFUSED, reason)
        return None

    def _open_directory(self, lock_timeout_s: float) -> int:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.directory / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot use {self.directory} for the KV disk tier ({exc}); "
                             f"pass a writable --kv-disk-dir") from exc
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise StoreError(
                        f"{self.directory} is used by another KV disk tier (another worker, "
                        f"or one not closed); give each worker its own --kv-disk-dir") from None
                time.sleep(0.05)

    def _rebuild(self) -> None:
        """Indexes the directory's valid files, oldest first; wipes the rest of ours."""
        found: list[tuple[int, str, BlockKey]] = []
        for path in self.directory.iterdir():
            name = path.name
            if name.startswith((_TEMP_PREFIX, _DOOMED_PREFIX)):
                blockfile.wipe_file(path)  # a write or a deletion cut short by a crash
            elif name.endswith(SUFFIX):
                key = self._read_key(path)
                if key is None:
                    self._ledger.stats.corrupt += 1
                    blockfile.wipe_file(path)
                else:
                    found.append((path.stat().st_mtime_ns, name, key))
        found.sort(key=lambda item: (item[0], item[1]))
        for mtime_ns, name, key in found:
            self._last_stamp = max(self._last_stamp, mtime_ns)
            victims = self._ledger.plan_room(key.tenant_id)  # capacity or quota shrank
            if isinstance(victims, RefusalReason):
                blockfile.wipe_file(self.directory / name)
                continue
            for victim in victims:
                blockfile.wipe_file(self._doom(self._ledger.pop(victim.entry_id, evicted=True)))
            self._ledger.insert(key, name)

    def _read_key(self, path: Path) -> BlockKey | None:
        """The key of a valid file of ours from its head, or None."""
        try:
            with open(path, "rb") as f:
                head = f.read(blockfile.MAX_HEAD_BYTES)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            return None
        key = blockfile.read_key(head, size, self._crypto, self._fp_digest, self.block_bytes)
        if key is None or path.name != self._file_name(
                key.block_hash, self._crypto.tenant_tag(key.tenant_id)):
            return None
        return key

    @staticmethod
    def _file_name(block_hash: BlockHash, tag: bytes) -> str:
        return f"{block_hash.hex()}-{tag.hex()}{SUFFIX}"

    def _stamp(self, name: str) -> None:
        """Sets the file's mtime from a strictly increasing clock (the file system's is
        coarse: ties would scramble the LRU order a restart rebuilds). Under the lock."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        with contextlib.suppress(OSError):
            os.utime(self.directory / name, ns=(self._last_stamp, self._last_stamp))

    def _doom(self, entry: Entry[str]) -> Path:
        """Renames an entry's file to a private name (under the lock), so wiping it later
        cannot hit a new file of the same block."""
        doomed = self.directory / f"{_DOOMED_PREFIX}{secrets.token_hex(8)}"
        try:
            os.rename(self.directory / entry.loc, doomed)
        except FileNotFoundError:
            pass  # already gone: nothing to wipe
        except OSError as exc:
            logger.warning("disk tier: cannot rename %s for deletion (%s)", entry.loc, exc)
            return self.directory / entry.loc
        return doomed
