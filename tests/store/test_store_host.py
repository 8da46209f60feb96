"""HostTier: LRU across tenants, quotas, tenant isolation, write-back callback, secure
deletion of the arena, counters and the change feed."""
from __future__ import annotations

import secrets

import numpy as np
import pytest

from splitserve.errors import StoreError
from splitserve.store import (ALL_TENANTS, BlockKey, HostTier, PurgeReport, PutOutcome,
                              RefusalReason, TierEvent, TierName)

BB = 256  # block bytes


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def key(i: int, tenant: str | None = "a", parent: int | None = None) -> BlockKey:
    return BlockKey(h(i), None if parent is None else h(parent), tenant)


def payload() -> bytes:
    return secrets.token_bytes(BB)  # random: a match in a scan is never a coincidence


def leaks(buffer: bytes, data: bytes) -> bool:
    """Whether any 32-byte piece of `data` is in `buffer`."""
    return any(data[i:i + 32] in buffer for i in range(0, len(data), 32))


def test_put_get_copy_and_lru_eviction_order() -> None:
    tier = HostTier(3 * BB, BB)
    blocks = {i: payload() for i in range(5)}
    for i in range(3):
        assert tier.put(key(i), blocks[i]).outcome is PutOutcome.STORED
    assert tier.get(h(0), "a") == blocks[0]  # 0 becomes most recent: LRU is 1, 2, 0
    assert tier.hashes() == [h(1), h(2), h(0)]
    result = tier.put(key(3), blocks[3])
    assert (result.outcome, result.evicted) == (PutOutcome.STORED, [key(1)])
    assert tier.put(key(2), blocks[2]).outcome is PutOutcome.ALREADY  # refreshed: 0, 3, 2
    assert tier.put(key(4), blocks[4]).evicted == [key(0)]
    assert tier.hashes() == [h(3), h(2), h(4)]
    assert [tier.get(h(i), "a") for i in range(5)] == [None, None, blocks[2], blocks[3],
                                                       blocks[4]]
    stats = tier.stats()
    assert (stats.blocks, stats.used_bytes, stats.evictions) == (3, 3 * BB, 2)
    assert stats.puts == {PutOutcome.STORED: 5, PutOutcome.ALREADY: 1}
    assert (stats.hits, stats.misses, stats.bytes_read) == (4, 2, 4 * BB)
    tier.check_invariants()


def test_other_tenant_never_hits_and_learns_nothing() -> None:
    tier, absent = HostTier(4 * BB, BB), HostTier(4 * BB, BB)
    secret = payload()
    tier.put(key(7, "A"), secret)
    absent.put(key(8, "A"), payload())  # the same traffic, without hash 7
    for t in (tier, absent):
        assert t.get(h(7), "B") is None and not t.contains(h(7), "B")
        assert t.get(h(7), None) is None and t.hashes("B") == []
    # Same counters whether A holds the hash or nobody does.
    assert tier.stats().misses == absent.stats().misses == 2
    assert tier.stats().hits == absent.stats().hits == 0
    # B's own copy of the same hash is B's: A's bytes stay A's.
    mine = payload()
    assert tier.put(key(7, "B"), mine).outcome is PutOutcome.STORED
    assert tier.get(h(7), "B") == mine and tier.get(h(7), "A") == secret
    tier.check_invariants()


def test_none_and_empty_tenant_are_one_tenant() -> None:
    tier = HostTier(2 * BB, BB)
    data = payload()
    tier.put(key(1, None), data)
    assert tier.get(h(1), "") == data
    assert tier.put(key(1, ""), data).outcome is PutOutcome.ALREADY
    assert tier.stats().tenant_used_bytes == {"": BB}


def test_quota_evicts_own_lru_first_and_is_never_exceeded() -> None:
    tier = HostTier(8 * BB, BB, tenant_quota_bytes=2 * BB + BB // 2, quotas={"big": 5 * BB})
    for i in range(3):
        tier.put(key(i, "b"), payload())
    tier.put(key(10, "a"), payload())
    tier.put(key(11, "a"), payload())
    result = tier.put(key(12, "a"), payload())
    # a's oldest goes, although b's blocks are older in the global LRU.
    assert result.evicted == [key(10, "a")]
    assert tier.stats().tenant_used_bytes == {"a": 2 * BB, "b": 2 * BB}
    for i in range(20, 26):
        tier.put(key(i, "big"), payload())
        assert tier.stats().tenant_used_bytes["big"] <= 5 * BB
    tier.check_invariants()


def test_quota_smaller_than_a_block_refuses_and_counts() -> None:
    tier = HostTier(4 * BB, BB, quotas={"tiny": BB - 1})
    result = tier.put(key(1, "tiny"), payload())
    assert (result.outcome, result.reason) == (PutOutcome.REFUSED, RefusalReason.QUOTA)
    assert tier.put(key(1, "other"), payload()).outcome is PutOutcome.STORED
    too_small = HostTier(BB - 1, BB)
    assert too_small.put(key(1), payload()).reason is RefusalReason.TOO_BIG
    stats = tier.stats()
    assert stats.refusals == {RefusalReason.QUOTA: 1}
    assert stats.puts == {PutOutcome.REFUSED: 1, PutOutcome.STORED: 1}
    assert too_small.stats().refusals == {RefusalReason.TOO_BIG: 1}


def test_on_evict_sees_the_bytes_before_the_slot_is_wiped() -> None:
    seen: list[tuple[BlockKey, bytes]] = []
    tier = HostTier(2 * BB, BB, on_evict=lambda k, view: seen.append((k, bytes(view))))
    first, second, third = payload(), payload(), payload()
    tier.put(key(1, parent=0), first)
    tier.put(key(2), second)
    tier.put(key(3), third)
    assert seen == [(key(1, parent=0), first)]
    arena = bytes(tier.arena_view())
    assert not leaks(arena, first) and leaks(arena, second) and leaks(arena, third)


def test_a_failing_callback_does_not_break_the_put() -> None:
    def boom(k: BlockKey, view: memoryview) -> None:
        raise RuntimeError("write-back failed")
    tier = HostTier(BB, BB, on_evict=boom)
    old = payload()
    tier.put(key(1), old)
    assert tier.put(key(2), payload()).evicted == [key(1)]
    assert not leaks(bytes(tier.arena_view()), old)
    tier.check_invariants()


def test_secure_deletion_after_remove_purge_and_evict() -> None:
    tier = HostTier(6 * BB, BB)
    a_blocks = [payload() for _ in range(4)]
    b_block = payload()
    for i, data in enumerate(a_blocks):
        tier.put(key(i, "A"), data)
    tier.put(key(9, "B"), b_block)
    assert tier.remove(h(0)) and not tier.remove(h(0))
    assert not leaks(bytes(tier.arena_view()), a_blocks[0])
    assert tier.purge_tenant("A") == PurgeReport(blocks=3, bytes=3 * BB)
    arena = bytes(tier.arena_view())
    assert not any(leaks(arena, data) for data in a_blocks)
    assert leaks(arena, b_block) and tier.get(h(9), "B") == b_block
    # Eviction wipes too: fill with C, B's block is pushed out and gone from the arena.
    for i in range(20, 26):
        tier.put(key(i, "C"), payload())
    assert not leaks(bytes(tier.arena_view()), b_block)
    stats = tier.stats()
    assert (stats.removals, stats.evictions, stats.blocks) == (4, 1, 6)
    assert tier.purge_tenant("A") == PurgeReport(0, 0)
    tier.check_invariants()


def test_remove_deletes_every_tenants_copy() -> None:
    tier = HostTier(4 * BB, BB)
    tier.put(key(1, "A"), payload())
    tier.put(key(1, "B"), payload())
    assert tier.remove(h(1))
    assert tier.hashes() == [] and tier.stats().tenant_used_bytes == {}


def test_payload_of_the_wrong_size_is_a_typed_error() -> None:
    tier = HostTier(2 * BB, BB)
    with pytest.raises(StoreError, match="255 bytes"):
        tier.put(key(1), bytes(BB - 1))
    with pytest.raises(StoreError, match="buffer"):
        tier.put(key(1), 12345)
    # Any C-contiguous buffer works: a numpy view of another dtype too.
    data = np.arange(BB // 2, dtype=np.uint16)
    tier.put(key(2), data)
    assert tier.get(h(2), "a") == data.tobytes()


def test_hashes_all_tenants_and_one_tenant() -> None:
    tier = HostTier(4 * BB, BB)
    tier.put(key(1, "A"), payload())
    tier.put(key(2, None), payload())
    assert tier.hashes(ALL_TENANTS) == tier.hashes() == [h(1), h(2)]
    assert tier.hashes(None) == tier.hashes("") == [h(2)]
    assert tier.keys() == [key(1, "A"), key(2, None)]


def test_events_start_with_a_resync_then_report_changes_and_overflow() -> None:
    tier = HostTier(2 * BB, BB)
    tier.put(key(1, parent=0), payload())
    tier.enable_events(max_records=6)
    assert tier.take_events() == [TierEvent(TierName.HOST, stored=(key(1, parent=0),),
                                            resync=True)]
    tier.put(key(2), payload())
    tier.put(key(3, "B"), payload())  # evicts 1
    tier.put(key(3, "C"), payload())  # evicts 2; hash 3 now held twice
    tier.remove(h(3))  # both copies go: one removal of hash 3
    assert tier.take_events() == [
        TierEvent(TierName.HOST, stored=(key(2),)),
        TierEvent(TierName.HOST, removed=(h(1),)),  # evicted for 3B, before 3B is stored
        TierEvent(TierName.HOST, stored=(key(3, "B"),)),
        TierEvent(TierName.HOST, removed=(h(2),)),
        TierEvent(TierName.HOST, stored=(key(3, "C"),)),
        TierEvent(TierName.HOST, removed=(h(3),)),
    ]
    assert tier.take_events() == []
    for i in range(10, 16):  # 6 stores + 4 evictions > 6 records: overflow
        tier.put(key(i), payload())
    assert tier.take_events() == [TierEvent(TierName.HOST, stored=(key(14), key(15)),
                                            resync=True)]
    assert tier.take_events() == []
