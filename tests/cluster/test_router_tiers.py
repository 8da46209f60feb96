"""Tier-aware routing (router/tiers.py): a prefix held in a worker's host or disk tier is
credited when loading it is predicted faster than recomputing it, and not otherwise; the
worker's own rule (store/engine_tiers.py) is the same. Default prefill prior: 5 ms +
t / 1500 s, so recomputing a 16-token block costs ~11 ms of a 512-token prompt."""
from __future__ import annotations

from splitserve.cluster.router.router import Role, RouteReason, RouteRequest, Router
from splitserve.kv_cache.events import AllBlocksCleared, BlockStored
from splitserve.store.block import BlockKey, TierName
from splitserve.store.engine_tiers import EngineTiers
from splitserve.store.host import HostTier
from splitserve.store.speed import TierSpeed
from splitserve.store.tiers import TieredStore

from test_router import load, make, request

SLOW = TierSpeed(latency_s=0.05, bytes_per_s=1e9)  # 50 ms a block: slower than recomputing
FAST = TierSpeed(latency_s=0.0002, bytes_per_s=2e9)  # ~0.4 ms a block


def _two_workers() -> tuple[Router, RouteRequest]:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    req = request(512)
    router.apply_tier_events("b", TierName.DISK, 1,
                             [BlockStored(tuple(req.block_hashes), None)])
    return router, req


def test_a_fast_tier_is_credited_and_wins_the_placement() -> None:
    router, req = _two_workers()
    router.tiers.speeds("b").overrides[TierName.DISK] = FAST
    decision = router.route(req)
    assert decision is not None
    assert decision.decode_worker == "b" and decision.num_cached_tokens == 496
    assert decision.reason is RouteReason.AGGREGATED
    assert router.stats().num_tier_blocks == 31


def test_a_tier_slower_than_recomputing_is_not_credited() -> None:
    router, req = _two_workers()
    router.tiers.speeds("b").overrides[TierName.DISK] = SLOW
    decision = router.route(req)
    assert decision is not None and decision.num_cached_tokens == 0
    assert decision.decode_worker == "a"  # ties go to the first registered worker


def test_host_before_disk_and_the_pool_first() -> None:
    """Pool blocks, then the rest from the host tier (fast) and the disk tier (slow):
    credit stops where the slow tier starts."""
    router, req = _two_workers()
    b = router.tiers.speeds("b")
    b.overrides.update({TierName.HOST: FAST, TierName.DISK: SLOW})
    router.apply_events("b", 0, [BlockStored(tuple(req.block_hashes[:4]), None)])
    router.apply_tier_events("b", TierName.HOST, 1,
                             [BlockStored(tuple(req.block_hashes[4:10]), None)])
    decision = router.route(req)
    assert decision is not None
    assert decision.decode_worker == "b" and decision.num_cached_tokens == 10 * 16


def test_a_gap_forgets_the_tier_until_a_resync() -> None:
    router, req = _two_workers()
    hashes = tuple(req.block_hashes)
    router.apply_tier_events("b", TierName.DISK, 3, [])
    assert router.tiers.num_blocks("b", TierName.DISK) == 0
    router.apply_tier_events("b", TierName.DISK, 4, [BlockStored(hashes, None)])
    assert router.tiers.num_blocks("b", TierName.DISK) == 0
    router.apply_tier_events("b", TierName.DISK, 5,
                             [AllBlocksCleared(), BlockStored(hashes[:3], None)])
    assert router.tiers.num_blocks("b", TierName.DISK) == 3
    router.remove_worker("b")
    assert router.tiers.num_blocks("b", TierName.DISK) == 0


def test_the_worker_loads_only_what_beats_recomputing() -> None:
    block_bytes = 1024
    store = TieredStore(HostTier(64 * block_bytes, block_bytes), None)
    hashes = [bytes([i]) * 16 for i in range(1, 9)]
    for i, h in enumerate(hashes):
        store.offload(BlockKey(h, hashes[i - 1] if i else None, "t"), bytes(block_bytes), True)
    tiers = EngineTiers(store, block_size=16)
    assert tiers.available(hashes, "t") == 8  # nothing measured yet: load what is there
    tiers.observe_prefill(256, 0.256)  # 1 ms a token: 16 ms a block
    tiers.speeds.overrides[TierName.HOST] = SLOW
    assert tiers.available(hashes, "t") == 0 and tiers.skipped == 8
    tiers.speeds.overrides[TierName.HOST] = FAST
    assert tiers.available(hashes, "t") == 8
    assert tiers.available(hashes, "other") == 0  # another tenant's blocks are not there
    store.close()
