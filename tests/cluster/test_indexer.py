"""PrefixIndex: lookups over chained hashes, event sequencing and resync, removal,
tenant accounting, memory bounded under distinct salts, and a property test against a
dict-of-sets model."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.cluster.router import indexer
from splitserve.cluster.router.indexer import PrefixIndex
from splitserve.cluster.router.router import (KVLayout, Role, RouteRequest, Router,
                                              RouterConfig, WorkerLoad)
from splitserve.kv_cache import KVCacheManager
from splitserve.kv_cache.block_hash import BlockHash, hash_full_blocks, root_hash
from splitserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
FP = "fp-test"


def chain(tokens: list[int], namespace: str | None = None) -> list[BlockHash]:
    return hash_full_blocks(root_hash(FP, namespace), tokens, BS)


H = chain(list(range(6 * BS)))  # six chained hashes h0..h5
G = chain([99] * BS + list(range(4 * BS)))  # another chain, sharing no block with H


def stored(hashes: list[BlockHash], parent: BlockHash | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent)


def test_match_counts_leading_blocks_per_worker() -> None:
    index = PrefixIndex()
    assert index.apply("a", 0, [stored(H[:4])])
    assert index.apply("b", 0, [stored(H[:2])])
    assert index.apply("c", 5, [stored(G[:3])])
    assert index.match(H) == {"a": 4, "b": 2}
    assert index.match(H[:1]) == {"a": 1, "b": 1}
    assert index.match(G) == {"c": 3}
    assert index.match([]) == {}
    assert (index.num_blocks, index.num_entries) == (7, 9)
    index.check_invariants()


def test_match_stops_at_a_workers_first_miss() -> None:
    index = PrefixIndex()
    index.apply("a", 0, [stored(H[:1]), stored(H[2:4], H[1])])  # h1 missing on a
    index.apply("b", 0, [stored(H[:3])])
    assert index.match(H) == {"a": 1, "b": 3}
    index.check_invariants()


def test_removing_a_block_on_one_worker_keeps_the_others() -> None:
    index = PrefixIndex()
    index.apply("a", 0, [stored(H[:4])])
    index.apply("b", 0, [stored(H[:4])])
    assert index.apply("a", 1, [BlockRemoved((H[1],))])
    assert index.match(H) == {"a": 1, "b": 4}
    assert (index.num_blocks, index.num_entries) == (4, 7)
    index.apply("b", 1, [BlockRemoved((H[1],))])
    # h1's node is gone (no holder left); h2, h3 stay indexed but unreachable.
    assert index.match(H) == {"a": 1, "b": 1}
    assert (index.num_blocks, index.num_entries) == (3, 6)
    index.check_invariants()


def test_all_blocks_cleared_and_remove_worker_drop_entries() -> None:
    index = PrefixIndex()
    index.apply("a", 0, [stored(H[:4])])
    index.apply("b", 0, [stored(H[:2]), stored(G[:2])])
    index.apply("a", 1, [AllBlocksCleared()])
    assert index.match(H) == {"b": 2}
    assert (index.num_blocks, index.num_entries) == (4, 4)
    index.remove_worker("b")
    assert index.match(H) == {} and index.match(G) == {}
    assert (index.num_blocks, index.num_entries) == (0, 0)
    assert index.worker_ids() == ["a"]
    # A new worker reuses b's slot without inheriting anything.
    index.apply("c", 0, [stored(G[:1])])
    assert index.match(G) == {"c": 1}
    assert index.match(H) == {}
    index.remove_worker("nobody")
    index.check_invariants()


def test_sequence_gap_needs_a_snapshot() -> None:
    index = PrefixIndex()
    assert index.apply("a", 7, [stored(H[:1])])  # the first batch may start anywhere
    assert index.apply("a", 7, [stored(H[1:2], H[0])])  # duplicate: ignored
    assert index.apply("a", 3, [AllBlocksCleared()])  # old: ignored
    assert index.match(H) == {"a": 1}
    assert index.apply("a", 8, [stored(H[1:2], H[0])])
    assert not index.apply("a", 10, [stored(H[2:3], H[1])])  # 9 is missing
    assert index.needs_resync("a")
    assert not index.apply("a", 11, [stored(H[3:4], H[2])])  # ignored until the snapshot
    assert index.match(H) == {"a": 2}  # stale entries stay meanwhile
    index.apply_snapshot("a", 11, [H[0], H[1], H[2], G[0]])
    assert not index.needs_resync("a")
    assert index.match(H) == {"a": 3} and index.match(G) == {"a": 1}
    assert index.apply("a", 11, [AllBlocksCleared()])  # covered by the snapshot: ignored
    assert index.apply("a", 12, [BlockRemoved((H[2],))])
    assert index.match(H) == {"a": 2}
    index.check_invariants()


def test_snapshot_replaces_everything_of_that_worker_only() -> None:
    index = PrefixIndex()
    index.apply("a", 0, [stored(H[:4])])
    index.apply("b", 0, [stored(H[:4])])
    index.apply_snapshot("a", 3, [G[0]])
    assert index.match(H) == {"b": 4}
    assert index.match(G) == {"a": 1}
    assert index.num_worker_blocks("a") == 1
    index.check_invariants()


def test_tenant_blocks_claimed_inherited_and_evicted_tail_first() -> None:
    index = PrefixIndex()
    ha, hb = chain(list(range(3 * BS)), "A"), chain(list(range(3 * BS)), "B")
    index.claim(ha, "A")  # dispatched before any worker stored them
    index.apply("w", 0, [stored(ha[:2])])
    # The decode worker's output block continues the chain: it inherits tenant A.
    index.apply("x", 0, [stored(ha[:3]), stored([b"\x01" * 16], ha[2])])
    index.apply("w", 1, [stored(hb)])  # never claimed: nobody's
    assert index.tenant_blocks("A") == 4
    assert index.tenant_blocks("B") == 0
    assert index.tenants() == ["A"]
    # Evicting 2 takes the chain's tail end first, never the root.
    evicted = index.evict_tenant("A", 2)
    assert evicted == {"x": [b"\x01" * 16, ha[2]]}
    assert index.tenant_blocks("A") == 2
    assert index.match(ha) == {"w": 2, "x": 2}
    evicted = index.evict_tenant("A", 5)
    assert evicted == {"w": [ha[1], ha[0]], "x": [ha[1], ha[0]]}
    assert index.match(ha) == {} and index.tenant_blocks("A") == 0
    index.check_invariants()


def test_index_follows_a_real_block_pool() -> None:
    """Events from KVCacheManager (allocation pressure evicts cached blocks) keep the
    index equal to the pool's own prefix lookups."""
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    mgr.pool.enable_events()
    index = PrefixIndex()
    root = root_hash(FP, None)
    prompts = [list(range(3 * BS)), list(range(2 * BS)) + [7] * BS, [5] * (4 * BS)]
    for seq, tokens in enumerate(prompts):
        hashes = hash_full_blocks(root, tokens, BS)
        hit = mgr.computed_prefix(hashes, len(tokens))
        assert mgr.allocate("r", len(tokens), hit) is not None
        mgr.cache_blocks("r", hashes, len(tokens), root)
        mgr.free("r")
        assert index.apply("w", seq, mgr.pool.take_events())
        for probe in prompts:
            probe_hashes = hash_full_blocks(root, probe, BS)
            expected = len(mgr.pool.cached_prefix(probe_hashes))
            assert index.match(probe_hashes).get("w", 0) == expected
        assert index.num_blocks == len(mgr.pool.cached_hashes())
    index.check_invariants()


# -- property test: random stores/removes against a dict-of-sets model -------------------------
WORKERS = ["w0", "w1", "w2"]
POOL = chain(list(range(8 * BS))) + chain(list(range(8 * BS)), "other")  # two chains of 8

op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(WORKERS), st.integers(0, 15),
              st.integers(1, 4)),
    st.tuples(st.just("remove"), st.sampled_from(WORKERS),
              st.lists(st.integers(0, 15), max_size=3)),
    st.tuples(st.just("clear"), st.sampled_from(WORKERS)),
    st.tuples(st.just("leave"), st.sampled_from(WORKERS)),
    st.tuples(st.just("snapshot"), st.sampled_from(WORKERS),
              st.lists(st.integers(0, 15), max_size=6)),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(op, max_size=40))
def test_index_matches_a_dict_of_sets_model(ops: list[tuple]) -> None:
    index = PrefixIndex()
    model: dict[str, set[BlockHash]] = {w: set() for w in WORKERS}
    seqs = {w: 0 for w in WORKERS}
    for kind, worker, *args in ops:
        seqs[worker] += 1
        if kind == "store":
            start, length = args
            end = min(start + length, 8 if start < 8 else 16)
            block_hashes = POOL[start:end]
            parent = POOL[start - 1] if start % 8 else None
            assert index.apply(worker, seqs[worker], [BlockStored(tuple(block_hashes), parent)])
            model[worker].update(block_hashes)
        elif kind == "remove":
            removed = [POOL[i] for i in args[0]]
            assert index.apply(worker, seqs[worker], [BlockRemoved(tuple(removed))])
            model[worker].difference_update(removed)
        elif kind == "clear":
            assert index.apply(worker, seqs[worker], [AllBlocksCleared()])
            model[worker].clear()
        elif kind == "leave":
            index.remove_worker(worker)
            model[worker].clear()
            seqs[worker] = 0
        else:
            held = [POOL[i] for i in args[0]]
            index.apply_snapshot(worker, seqs[worker], held)
            model[worker] = set(held)
        index.check_invariants()
        assert index.num_entries == sum(len(s) for s in model.values())
        assert index.num_blocks == len(set().union(*model.values()))
        for probe in (POOL[:8], POOL[8:], POOL[:3]):
            expected = {}
            for w, held_set in model.items():
                n = 0
                while n < len(probe) and probe[n] in held_set:
                    n += 1
                if n:
                    expected[w] = n
            assert index.match(probe) == expected


def test_pending_claims_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(indexer, "MAX_PENDING_CLAIMS", 2)
    index = PrefixIndex()
    chains = [chain(list(range(2 * BS)), f"ns{i}") for i in range(3)]
    for i, hashes in enumerate(chains):
        index.claim(hashes, f"t{i}")  # only the first unindexed hash is remembered
    for seq, hashes in enumerate(chains):
        index.apply("w", seq, [stored(hashes)])
    # The oldest claim was forgotten: chain 0 is nobody's.
    assert [index.tenant_blocks(f"t{i}") for i in range(3)] == [0, 2, 2]
    index.check_invariants()


# -- bounded per-namespace state ----------------------------------------------------------------

def _serve_distinct_salts(router: Router, mgr: KVCacheManager, salts: range,
                          seq: list[int]) -> None:
    """One request per salt (its tenant too, as with no API keys) through the router and
    an engine's block pool, as the dispatcher and a worker do: route, dispatch (claim),
    compute and cache, KV events back, finish, tenant-cap evictions."""
    tokens = list(range(3 * BS))
    for salt in salts:
        name = f"salt-{salt}"
        hashes = hash_full_blocks(root_hash(FP, name), tokens, BS)
        req = RouteRequest(name, hashes, len(tokens), tenant=name)
        decision = router.route(req)
        assert decision is not None
        router.on_dispatched(decision, req)
        hit = mgr.computed_prefix(hashes, len(tokens))
        assert mgr.allocate(name, len(tokens), hit) is not None
        mgr.cache_blocks(name, hashes, len(tokens), root_hash(FP, name))
        mgr.free(name)
        seq[0] += 1
        assert router.apply_events("w", seq[0], mgr.pool.take_events())
        router.on_finished(name)
        mgr.pool.evict_cached(router.take_evictions().get("w", []))


def test_distinct_salts_leave_memory_flat() -> None:
    """100,000 distinct salts (namespaces and tenants) through the router and a 64-block
    pool: once the pool and the bounded caches (root hashes: 4,096) have turned over, the
    number of live Python objects no longer grows. (PrefixIndex kept an empty LRU per
    tenant forever, ServiceRate a time per finished request.)"""
    import gc
    import sys

    router = Router(RouterConfig(tenant_max_cached_blocks=2))
    router.set_kv_layout(KVLayout(BS, 1024))
    router.add_worker("w", Role.BOTH, WorkerLoad(0, 0, 0, 0, 1 << 20, 1 << 20))
    mgr = KVCacheManager(num_blocks=64, block_size=BS)
    mgr.pool.enable_events()
    seq = [-1]
    _serve_distinct_salts(router, mgr, range(0, 5_000), seq)  # warm: pool and caches full
    gc.collect()
    before = sys.getallocatedblocks()
    _serve_distinct_salts(router, mgr, range(5_000, 100_000), seq)
    gc.collect()
    grown = sys.getallocatedblocks() - before
    index = router.index
    assert index.num_tenants <= index.num_blocks <= 64
    assert index.num_pending_claims == 0
    index.check_invariants()
    # one object kept per salt would be 95,000 blocks
    assert grown < 1_000, f"{grown} more memory blocks after 95,000 more salts"
