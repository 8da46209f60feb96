"""The startup heap is frozen out of the cyclic collector's walks (cluster/heap.py); the
serving processes doing it at startup is checked in tests/api/test_serving_e2e.py."""
from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from splitserve.cluster.heap import freeze_startup_heap, pause_collector


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # this test process goes on collecting as before
    gc.enable()


def test_the_heap_is_collected_then_frozen(unfrozen: None) -> None:
    pause_collector()  # as a serving process starts: no collection while it builds
    assert not gc.isenabled()
    kept = [_Node() for _ in range(1000)]  # a startup object, still in use
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # garbage in a cycle: only the collector frees it
    cycle = weakref.ref(a)
    del a, b
    assert cycle() is not None
    frozen = freeze_startup_heap("test")
    assert gc.isenabled(), "the collector is back on once the startup heap is frozen"
    assert cycle() is None, "garbage is collected, not frozen"
    assert frozen >= len(kept)  # (the count moves as other threads free frozen objects)
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(o) in tracked for o in kept), "a full collection no longer walks them"
    fresh = _Node()
    assert any(o is fresh for o in gc.get_objects()), "what comes later is collected as usual"
