"""Stateful property test: random requests drive KVCacheManager like a scheduler would.

Besides `check_invariants()` after every rule, the machine models what the GPU would
hold: `content[block_id]` is the hash of the tokens last written into a block. A prefix
hit must return blocks whose content matches, a block being written must be exclusively
owned and uncached, and replaying the KV events must rebuild the pool's cached hash set,
also when the event backlog overflows between drains (the pool then reports a resync).
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from splitserve.kv_cache import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager,
                                 KVEvent, hash_full_blocks, root_hash)
from splitserve.kv_cache.events import EventLog

BS = 2
NUM_BLOCKS = 8
ROOT = root_hash("fp", "tenant")
REQUEST_IDS = [f"r{i}" for i in range(4)]
# A tiny vocabulary so prompts share prefixes often.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=10)


def has_requests(machine: KVCacheMachine) -> bool:
    return bool(machine.tokens)


class KVCacheMachine(RuleBasedStateMachine):
    enable_prefix_caching = True
    max_pending_hashes: int | None = None  # the pool's default

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, self.enable_prefix_caching)
        self.pool = self.mgr.pool
        self.pool.enable_events(self.max_pending_hashes)
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.content: dict[int, bytes | None] = {}
        self.parent_of: dict[bytes, bytes | None] = {}
        self.index: set[bytes] = set()  # the router's view, rebuilt from events
        self.prompts: list[list[int]] = []

    def hashes(self, tokens: list[int]) -> list[bytes]:
        hs = hash_full_blocks(ROOT, tokens, BS)
        for i, h in enumerate(hs):
            self.parent_of[h] = hs[i - 1] if i else None
        return hs

    def snapshot(self) -> tuple[object, ...]:
        return (list(self.pool._free_queue), dict(self.pool._cached),
                [self.pool.block(i).ref_cnt for i in range(NUM_BLOCKS)],
                {r: self.mgr.block_table(r) for r in self.tokens},
                len(self.log._pending), self.log.overflowed)

    @property
    def log(self) -> EventLog:
        assert self.pool._events is not None
        return self.pool._events

    def check_hit(self, block_ids: list[int], hs: list[bytes]) -> None:
        assert len(block_ids) <= len(hs)
        for block_id, h in zip(block_ids, hs):
            assert self.pool.block(block_id).block_hash == h
            assert self.content.get(block_id) == h, "hit on a block holding other tokens"

    def active(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.tokens)), label="request_id")

    @precondition(lambda self: len(self.tokens) < len(REQUEST_IDS))
    @rule(data=st.data(), tokens=TOKENS, reuse=st.booleans(), prefill=st.booleans())
    def start(self, data: st.DataObject, tokens: list[int], reuse: bool,
              prefill: bool) -> None:
        idle = [r for r in REQUEST_IDS if r not in self.tokens]
        request_id = data.draw(st.sampled_from(idle), label="request_id")
        if reuse and self.prompts:
            # Extend an earlier prompt's prefix, so prefix hits are common.
            earlier = data.draw(st.sampled_from(self.prompts), label="earlier")
            cut = data.draw(st.integers(0, len(earlier)), label="cut")
            tokens = earlier[:cut] + tokens[:3]
        self.prompts.append(tokens)
        hs = self.hashes(tokens)
        hit = self.mgr.computed_prefix(hs, len(tokens))
        assert len(hit) <= (len(tokens) - 1) // BS
        self.check_hit(hit, hs)
        before = self.snapshot()
        num_free = self.pool.num_free_blocks
        num_free_hits = sum(self.pool.block(b).ref_cnt == 0 for b in hit)
        new_ids = self.mgr.allocate(request_id, len(tokens), hit)
        num_needed = -(-len(tokens) // BS) - len(hit)
        if new_ids is None:
            assert num_needed + num_free_hits > num_free
            assert self.snapshot() == before, "a failed allocate changed state"
            return
        assert self.mgr.block_table(request_id) == hit + new_ids
        assert len(new_ids) == num_needed
        self.tokens[request_id] = tokens
        self.num_computed[request_id] = len(hit) * BS
        if prefill:
            self.run_model(request_id, len(tokens), cache=True)

    @precondition(has_requests)
    @rule(data=st.data(), num=st.integers(1, 8), cache=st.booleans())
    def compute(self, data: st.DataObject, num: int, cache: bool) -> None:
        self.run_model(self.active(data), num, cache)

    def run_model(self, request_id: str, num: int, cache: bool) -> None:
        tokens, table = self.tokens[request_id], self.mgr.block_table(request_id)
        hs = self.hashes(tokens)
        start = self.num_computed[request_id]
        end = min(len(tokens), start + num)
        # "Run the model": write KV into every block the new tokens touch.
        for i in range(start // BS, -(-end // BS)):
            block = self.pool.block(table[i])
            assert block.ref_cnt == 1, f"writing into shared block {block.block_id}"
            assert block.block_hash is None, f"writing into cached block {block.block_id}"
            self.content[block.block_id] = hs[i] if (i + 1) * BS <= end else None
        self.num_computed[request_id] = end
        if cache:
            self.mgr.cache_blocks(request_id, hs, end, ROOT)
            assert self.mgr.num_cached_blocks(request_id) >= end // BS
            for i in range(end // BS):
                # Registered, or an uncached duplicate of a block cached by another request.
                assert self.pool.block(table[i]).block_hash in (hs[i], None)
                holder = self.pool.lookup(hs[i])
                assert holder is None or self.content[holder] == hs[i]

    @precondition(has_requests)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        request_id = self.active(data)
        tokens = self.tokens[request_id] + extra
        before = self.snapshot()
        new_ids = self.mgr.allocate(request_id, len(tokens))
        if new_ids is None:
            assert self.snapshot() == before, "a failed allocate changed state"
            return
        assert len(self.mgr.block_table(request_id)) == -(-len(tokens) // BS)
        self.tokens[request_id] = tokens

    @rule(request_id=st.sampled_from(REQUEST_IDS))
    def free(self, request_id: str) -> None:
        self.mgr.free(request_id)
        self.tokens.pop(request_id, None)
        self.num_computed.pop(request_id, None)
        assert self.mgr.block_table(request_id) == []

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        hs = self.hashes(tokens)
        self.check_hit(self.pool.cached_prefix(hs), hs)
        for h in hs:
            block_id = self.pool.lookup(h)
            assert block_id is None or self.pool.block(block_id).block_hash == h

    @rule(dice=st.integers(0, 7))
    def evict_all(self, dice: int) -> None:
        if dice:  # a cache reset is rare; doing it often would hide every hit
            return
        self.pool.evict_all_cached()
        assert all(self.pool.block(b).block_hash is None for b in self.pool._free_queue)

    def replay(self, index: set[bytes], events: list[KVEvent]) -> set[bytes]:
        """Apply events to a router-side index of cached hashes, checking them on the way."""
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_hash
                for h in event.block_hashes:
                    assert h not in index, "stored twice without a removal"
                    assert self.parent_of[h] == parent, "event chain breaks the hash chain"
                    index.add(h)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    index.remove(h)
            else:
                assert isinstance(event, AllBlocksCleared)
                index.clear()
        return index

    @rule()
    def publish_events(self) -> None:
        # Events pile up over several rules between drains, as over a worker's step.
        self.index = self.replay(self.index, self.pool.take_events())

    @invariant()
    def consistent(self) -> None:
        self.mgr.check_invariants()
        if self.log.overflowed:
            return  # the backlog is gone: the next drain resyncs, publish_events replays it
        pending = [event.freeze() for event in self.log._pending]  # peek, do not drain
        cached = {self.pool.block(i).block_hash for i in range(NUM_BLOCKS)} - {None}
        assert self.replay(set(self.index), pending) == cached, (
            "events do not replay to the cached set")


class KVCacheMachineNoPrefixCaching(KVCacheMachine):
    enable_prefix_caching = False


class KVCacheMachineTinyBacklog(KVCacheMachine):
    """At most 3 hashes wait between drains: many drains follow an overflow."""
    max_pending_hashes = 3


_settings = settings(max_examples=120, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestKVCacheStateful = KVCacheMachine.TestCase
TestKVCacheStateful.settings = _settings
TestKVCacheStatefulNoPrefixCaching = KVCacheMachineNoPrefixCaching.TestCase
TestKVCacheStatefulNoPrefixCaching.settings = settings(_settings, max_examples=30)
TestKVCacheStatefulTinyBacklog = KVCacheMachineTinyBacklog.TestCase
TestKVCacheStatefulTinyBacklog.settings = settings(_settings, max_examples=60)
