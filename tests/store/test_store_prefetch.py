"""Prefetch (store/prefetch.py): a request's prefix blocks on disk are read into the host
tier by a background thread, in order, up to the first block not there; blocks already
in the host tier are skipped; another tenant's prefetch brings nothing up."""
from __future__ import annotations

import secrets
import time
from pathlib import Path

from splitserve.store import BlockKey, DiskTier, HostTier, TieredStore, new_master_key
from splitserve.store.prefetch import Prefetcher

BB = 256
KEY = new_master_key()


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _store(tmp_path: Path) -> TieredStore:
    store = TieredStore(HostTier(16 * BB, BB), DiskTier(tmp_path, 16 * BB, BB, "fp", KEY))
    for i in range(5):  # on disk only
        assert store.disk is not None
        store.disk.put(BlockKey(h(i), h(i - 1) if i else None, "a"), secrets.token_bytes(BB),
                       reused=True)
    return store


def _wait(prefetcher: Prefetcher, n: int) -> None:
    deadline = time.monotonic() + 10.0
    while prefetcher.prefetched < n and time.monotonic() < deadline:
        time.sleep(0.01)


def test_disk_blocks_come_up_to_host_in_order(tmp_path: Path) -> None:
    store = _store(tmp_path)
    prefetcher = Prefetcher(store)
    assert store.host is not None
    prefetcher.submit([h(i) for i in (0, 1, 2, 7, 3)], "a")  # h(7) is nowhere: stop there
    _wait(prefetcher, 3)
    prefetcher.close()
    assert prefetcher.prefetched == 3
    assert [store.host.contains(h(i), "a") for i in range(5)] == [True] * 3 + [False] * 2
    store.close()


def test_host_blocks_are_skipped_and_other_tenants_get_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert store.host is not None
    store.host.put(BlockKey(h(0), None, "a"), secrets.token_bytes(BB))
    prefetcher = Prefetcher(store)
    prefetcher.submit([h(i) for i in range(5)], "b")
    prefetcher.submit([h(i) for i in range(5)], "a")
    _wait(prefetcher, 4)
    prefetcher.close()
    assert prefetcher.prefetched == 4  # h(0) was in host already; b's found nothing
    assert not any(store.host.contains(h(i), "b") for i in range(5))
    store.close()
