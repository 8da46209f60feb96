"""Prefetch: when a request reaches a worker, the blocks of its prefix that sit on disk
are read (and decrypted) into the host tier by a background thread while the request
waits in the engine's queue, so the engine step that admits it copies them from memory
instead of reading files (DESIGN.md 6; Mooncake and LMCache prefetch the same way).

Best effort: the queue is bounded (a full queue drops the request's prefetch, counted);
a block the engine promotes first is simply found in the host tier and skipped; nothing
waits on the thread except `close`, which has a deadline.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

from splitserve.kv_cache import BlockHash

from .block import TierName
from .tiers import TieredStore

logger = logging.getLogger(__name__)

_STOP = None


class Prefetcher:
    def __init__(self, store: TieredStore, max_pending: int = 64) -> None:
        self.store = store
        self.prefetched = 0  # blocks read from disk into the host tier
        self.dropped = 0  # requests whose prefetch found the queue full
        self._queue: queue.Queue[tuple[list[BlockHash], str | None] | None] = queue.Queue(
            max_pending)
        self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self.store.host is not None and self.store.disk is not None

    def submit(self, block_hashes: Sequence[BlockHash], tenant: str | None) -> None:
        """Prefetch these blocks (a prefix's continuation below the pool), in order."""
        if not block_hashes or not self.enabled:
            return
        try:
            self._queue.put_nowait((list(block_hashes), tenant))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            hashes, tenant = item
            try:
                self._prefetch(hashes, tenant)
            except Exception:  # a prefetch is an optimization: never the worker's end
                logger.exception("KV prefetch failed")

    def _prefetch(self, hashes: list[BlockHash], tenant: str | None) -> None:
        host = self.store.host
        assert host is not None
        for block_hash in hashes:
            if host.contains(block_hash, tenant):
                continue
            found = self.store.load(block_hash, tenant)  # a disk hit is promoted to host
            if found is None or found[0] is not TierName.DISK:
                return  # the prefix ends here (or it was not on disk after all)
            self.prefetched += 1
