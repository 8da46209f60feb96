"""The disk tier's one writer thread: blocks evicted from the host tier (or offloaded
straight to disk) wait in a bounded queue, so the engine thread copies a block and goes
on while encryption and file I/O happen here.

A purge must leave nothing of the tenant behind, the queue and the write in flight
included: `purge_tenant` holds the write lock (no write in progress), drops the tenant's
queued copies (zeroed) and bumps the tenant's epoch, so a block taken off the queue before
the purge and written after it is recognised as older than the purge and dropped.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

from splitserve.errors import StoreError

from .block import BlockKey, PurgeReport, RefusalReason, tenant_id
from .disk import DiskTier

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 1.0  # the thread re-checks for close at least this often


@dataclass(slots=True)
class _Write:
    key: BlockKey
    payload: bytearray  # our own copy: zeroed once written or dropped
    reused: bool
    epoch: int  # the tenant's purge epoch when queued


def _zero(buffer: bytearray) -> None:
    np.frombuffer(buffer, dtype=np.uint8)[:] = 0


class DiskWriter:
    """A bounded queue of disk writes and the daemon thread that does them."""

    def __init__(self, disk: DiskTier, max_blocks: int, lock_timeout_s: float = 10.0) -> None:
        if max_blocks <= 0:
            raise ValueError(f"the disk write queue needs room for at least one block, got "
                             f"max_blocks={max_blocks}")
        self.disk = disk
        self.max_blocks = max_blocks
        self.lock_timeout_s = lock_timeout_s
        self._items: deque[_Write] = deque()
        self._in_flight: _Write | None = None
        self._epochs: dict[str, int] = {}
        self._closing = False
        self._abandoned = False
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()  # held around one disk write, or a purge
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, key: BlockKey, payload: memoryview, reused: bool) -> bool:
        """Queues a copy of the block; False (nothing queued) when full or closing."""
        with self._cond:
            if self._closing or len(self._items) >= self.max_blocks:
                return False
            epoch = self._epochs.get(key.tenant_id, 0)
            self._items.append(_Write(key, bytearray(payload), reused, epoch))
            self._cond.notify_all()
            return True

    def queued(self) -> int:
        with self._cond:
            return len(self._items) + (self._in_flight is not None)

    def purge_tenant(self, tenant: str | None) -> PurgeReport:
        """Drops the tenant's queued writes, then purges its files from the disk tier."""
        tenant = tenant_id(tenant)
        if not self._write_lock.acquire(timeout=self.lock_timeout_s):
            raise StoreError(f"purging tenant {tenant!r}: a disk write did not finish within "
                             f"{self.lock_timeout_s:.0f} s; retry the purge")
        try:
            with self._cond:
                self._epochs[tenant] = self._epochs.get(tenant, 0) + 1
                kept: deque[_Write] = deque()
                for item in self._items:
                    if item.key.tenant_id == tenant:
                        _zero(item.payload)
                    else:
                        kept.append(item)
                self._items = kept
                self._cond.notify_all()
            return self.disk.purge_tenant(tenant)
        finally:
            self._write_lock.release()

    def flush(self, timeout_s: float) -> bool:
        """Waits until every queued write is done; False if `timeout_s` passed first."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._items and self._in_flight is None, timeout=timeout_s)

    def close(self, timeout_s: float) -> bool:
        """Writes what is queued (a restart then finds it) and stops the thread; after
        `timeout_s` the rest is dropped (zeroed). False if the thread did not stop."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            self._abandoned = True
            for item in self._items:
                _zero(item.payload)
            self._items.clear()
            self._cond.notify_all()
        return not self._thread.is_alive()

    def _next(self) -> _Write | None:
        with self._cond:
            while not self._items and not self._closing:
                self._cond.wait(_IDLE_WAIT_S)
            if self._abandoned or not self._items:
                return None
            self._in_flight = self._items.popleft()
            return self._in_flight

    def _run(self) -> None:
        while (item := self._next()) is not None:
            try:
                self._write(item)
            except Exception:  # noqa: BLE001 - one bad block must not stop every later write
                logger.exception("disk writer: block %s failed", item.key.block_hash.hex())
            finally:
                _zero(item.payload)
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()

    def _write(self, item: _Write) -> None:
        if not self._write_lock.acquire(timeout=self.lock_timeout_s):
            self.disk.note_refusal(RefusalReason.BUSY)  # a purge held the disk too long
            return
        try:
            with self._cond:
                if self._epochs.get(item.key.tenant_id, 0) != item.epoch:
                    return  # the tenant was purged after this block was queued
            self.disk.put(item.key, item.payload, reused=item.reused)
        finally:
            self._write_lock.release()
