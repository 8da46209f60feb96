"""Stateful property tests: random puts, gets, removes and purges drive a HostTier and a
DiskTier (with restarts and damaged files) against a plain model of what they must hold.

The model is the specification in a few lines: an LRU list of (tenant, hash) -> payload;
a new block of a tenant over its quota evicts that tenant's oldest blocks, then a full
tier evicts the oldest of all; no tenant (None) and "" are one tenant. After every step:
used bytes, per-tenant bytes, capacity and quotas match the model, and the tier's own
invariant check passes (free arena slots are zeros; the index matches the files).
"""
from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from splitserve.store import (BlockKey, DiskTier, HostTier, PurgeReport, PutOutcome,
                              RefusalReason, TierStats, new_master_key)

BB = 16
CAPACITY = 5 * BB
QUOTA = 3 * BB  # the default per tenant
QUOTAS: dict[str | None, int] = {"b": 2 * BB + BB // 2, "c": BB - 1}  # "c" can store nothing
TENANTS = st.sampled_from([None, "", "a", "b", "c"])
HASHES = st.integers(0, 5)
PAYLOADS = st.binary(min_size=BB, max_size=BB)
COUNTERS = ("hits", "misses", "evictions", "removals", "corrupt", "bytes_read",
            "bytes_written")


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def tid(tenant: str | None) -> str:
    return "" if tenant is None else tenant


def norm(key: BlockKey) -> tuple[str, bytes, bytes | None]:
    """A key as the tier must keep it (a rebuilt index spells the tenant "" as None)."""
    return (key.tenant_id, key.block_hash, key.parent_hash)


def quota_of(tenant: str) -> int:
    return QUOTAS.get(tenant, QUOTA)


class TierMachine(RuleBasedStateMachine):
    """Rules and checks shared by both tiers; subclasses make the tier and its put."""

    tier: HostTier | DiskTier

    def __init__(self) -> None:
        super().__init__()
        self.model: OrderedDict[tuple[str, bytes], tuple[BlockKey, bytes]] = OrderedDict()
        self.last: TierStats | None = None

    def put_block(self, key: BlockKey, data: bytes) -> object:
        raise NotImplementedError

    def expected_put(self, key: BlockKey) -> tuple[PutOutcome, RefusalReason | None,
                                                   list[BlockKey]]:
        entry_id = (key.tenant_id, key.block_hash)
        if entry_id in self.model:
            return PutOutcome.ALREADY, None, []
        max_blocks = quota_of(key.tenant_id) // BB
        if max_blocks == 0:
            return PutOutcome.REFUSED, RefusalReason.QUOTA, []
        own = [eid for eid in self.model if eid[0] == key.tenant_id]
        victims = own[:max(len(own) + 1 - max_blocks, 0)]
        others = [eid for eid in self.model if eid not in victims]
        victims += others[:max(len(self.model) - len(victims) + 1 - CAPACITY // BB, 0)]
        return PutOutcome.STORED, None, [self.model[v][0] for v in victims]

    def apply_put(self, key: BlockKey, data: bytes, result: object) -> None:
        outcome, reason, evicted = self.expected_put(key)
        assert (result.outcome, result.reason) == (outcome, reason)  # type: ignore[attr-defined]
        assert ([norm(k) for k in result.evicted]  # type: ignore[attr-defined]
                == [norm(k) for k in evicted])
        entry_id = (key.tenant_id, key.block_hash)
        for victim in evicted:
            del self.model[(victim.tenant_id, victim.block_hash)]
        if outcome is PutOutcome.STORED:
            self.model[entry_id] = (key, data)
        elif outcome is PutOutcome.ALREADY:
            self.model.move_to_end(entry_id)

    @rule(tenant=TENANTS, i=HASHES, parent=st.none() | HASHES, data=PAYLOADS)
    def put(self, tenant: str | None, i: int, parent: int | None, data: bytes) -> None:
        key = BlockKey(h(i), None if parent is None else h(parent), tenant)
        self.apply_put(key, data, self.put_block(key, data))

    @rule(tenant=TENANTS, i=HASHES)
    def get(self, tenant: str | None, i: int) -> None:
        entry_id = (tid(tenant), h(i))
        expected = self.model.get(entry_id)
        assert self.tier.get(h(i), tenant) == (None if expected is None else expected[1])
        assert self.tier.contains(h(i), tenant) is (expected is not None)
        if expected is not None:
            self.model.move_to_end(entry_id)

    @rule(data=st.data())
    def get_held(self, data: st.DataObject) -> None:
        """A hit (random gets mostly miss): moves a block to the LRU's end."""
        if self.model:
            tenant, block_hash = data.draw(st.sampled_from(list(self.model)))
            self.get(tenant, int.from_bytes(block_hash, "little"))

    @rule(i=HASHES)
    def remove(self, i: int) -> None:
        doomed = [eid for eid in self.model if eid[1] == h(i)]
        assert self.tier.remove(h(i)) is bool(doomed)
        for eid in doomed:
            del self.model[eid]

    @rule(tenant=TENANTS)
    def purge(self, tenant: str | None) -> None:
        doomed = [eid for eid in self.model if eid[0] == tid(tenant)]
        assert self.tier.purge_tenant(tenant) == PurgeReport(len(doomed), len(doomed) * BB)
        for eid in doomed:
            del self.model[eid]

    @invariant()
    def accounting_matches_the_model(self) -> None:
        self.tier.check_invariants()
        stats = self.tier.stats()
        per_tenant: dict[str, int] = {}
        for tenant, _ in self.model:
            per_tenant[tenant] = per_tenant.get(tenant, 0) + BB
        assert stats.used_bytes == len(self.model) * BB <= CAPACITY
        assert stats.blocks == len(self.model)
        assert stats.tenant_used_bytes == per_tenant
        assert all(used <= quota_of(t) for t, used in per_tenant.items())
        assert [norm(k) for k in self.tier.keys()] == [norm(k) for k, _ in self.model.values()]
        if self.last is not None:  # counters only go up
            for name in COUNTERS:
                assert getattr(stats, name) >= getattr(self.last, name), name
            for outcome, count in self.last.puts.items():
                assert stats.puts.get(outcome, 0) >= count
        self.last = stats


class HostMachine(TierMachine):
    tier: HostTier

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(CAPACITY, BB, tenant_quota_bytes=QUOTA, quotas=QUOTAS)

    def put_block(self, key: BlockKey, data: bytes) -> object:
        return self.tier.put(key, data)


class DiskMachine(TierMachine):
    master_key = new_master_key()
    tier: DiskTier

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="store-stateful-")
        self.tier = self.open()

    def open(self) -> DiskTier:
        return DiskTier(self.directory, CAPACITY, BB, "fp", self.master_key,
                        tenant_quota_bytes=QUOTA, quotas=QUOTAS)

    def put_block(self, key: BlockKey, data: bytes) -> object:
        raise AssertionError("the disk machine puts through put_reused")

    @rule(tenant=TENANTS, i=HASHES, parent=st.none() | HASHES, data=PAYLOADS,
          reused=st.booleans())
    def put(self, tenant: str | None, i: int, parent: int | None,  # type: ignore[override]
            data: bytes, reused: bool) -> None:
        key = BlockKey(h(i), None if parent is None else h(parent), tenant)
        result = self.tier.put(key, data, reused=reused)
        if not reused and (key.tenant_id, key.block_hash) not in self.model:
            assert (result.outcome, result.reason) == (PutOutcome.REFUSED,
                                                       RefusalReason.NOT_ADMITTED)
            return
        self.apply_put(key, data, result)

    @invariant()
    def file_times_keep_the_lru_order(self) -> None:
        """What a restart rebuilds the LRU order from, checked at every step."""
        paths = [self.tier.path_of(k.block_hash, k.tenant) for k in self.tier.keys()]
        stamps = [p.stat().st_mtime_ns for p in paths if p is not None]
        assert len(stamps) == len(paths) and stamps == sorted(set(stamps))

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = self.open()
        self.last = None  # a new tier counts from zero

    @rule(data=st.data())
    def damage_a_file(self, data: st.DataObject) -> None:
        if not self.model:
            return
        tenant, block_hash = data.draw(st.sampled_from(list(self.model)))
        path = self.tier.path_of(block_hash, tenant)
        assert path is not None
        raw = bytearray(path.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(raw)
        corrupt = self.tier.stats().corrupt
        assert self.tier.get(block_hash, tenant) is None
        assert self.tier.stats().corrupt == corrupt + 1
        del self.model[(tenant, block_hash)]

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.directory, ignore_errors=True)


SETTINGS = settings(max_examples=50, deadline=None)
TestHostTier = HostMachine.TestCase
TestHostTier.settings = SETTINGS
TestDiskTier = DiskMachine.TestCase
TestDiskTier.settings = SETTINGS
