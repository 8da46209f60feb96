"""Peer fetch in the router (router/peer.py): a local decision imports a longer prefix
another worker holds (pool or tiers) when that is predicted faster than recomputing it.

Default priors (see test_router.py): prefill(t) = 5 ms + t / 1500 s, decode step(n) =
20 ms + 4 ms * n, KV 23040 B a token at 2 GB/s + 2 ms a transfer; block size 16. A
512-token prompt leaves its last block to compute: the longest prefix is 496 tokens.
"""
from __future__ import annotations

import pytest

from splitserve.cluster.router.cost_model import CostModelConfig
from splitserve.cluster.router.load import InFlight
from splitserve.cluster.router.router import (DisaggPolicy, Role, RouteDecision, RouteReason,
                                              RouterConfig)
from splitserve.kv_cache.events import BlockStored
from splitserve.store.block import TierName
from splitserve.store.speed import TierSpeed

from test_router import BS, cache, load, make, prefill, request, step

KV_BYTES = 23040
FULL = load(running=8, max_num_seqs=8)  # no room for another sequence: cannot decode it


def fetch_s(num_tokens: int, bandwidth: float = 2e9) -> float:
    return 0.002 + num_tokens * KV_BYTES / bandwidth


def peer_of(decision: RouteDecision | None) -> tuple[str, int, str]:
    """(decode worker, fetched tokens, holder) of a local decision with a peer."""
    assert decision is not None and decision.prefill_worker is None
    assert decision.peer is not None
    assert decision.num_cached_tokens == decision.peer.num_tokens
    return decision.decode_worker, decision.peer.num_tokens, decision.peer.worker


def test_an_idle_worker_fetches_the_busy_holders_prefix() -> None:
    req = request(512)
    for peer_fetch in (True, False):
        router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()), peer_fetch=peer_fetch)
        cache(router, "a", req, 20)
        decision = router.route(req)
        assert decision is not None and decision.decode_worker == "b"
        assert decision.reason is RouteReason.AGGREGATED  # the reason is the local one's
        if not peer_fetch:
            assert decision.peer is None and decision.num_cached_tokens == 0
            assert decision.predicted_s == pytest.approx(prefill(512) + step(1))
            assert router.stats().num_peer_fetches == 0
            continue
        assert peer_of(decision) == ("b", 320, "a")
        assert decision.peer is not None
        cost = step(9) + fetch_s(320)  # a's queue is empty
        assert decision.peer.predicted_s == pytest.approx(cost)
        # The local prediction with b's prefill of 512 tokens traded for 192 plus the fetch.
        assert decision.predicted_s == pytest.approx(prefill(192) + step(1) + cost)
        assert router.stats().num_peer_fetches == 1


def test_the_holder_with_the_largest_net_gain_is_taken() -> None:
    """c holds more than a, but a's prefix arrives sooner: the larger gain - cost wins."""
    req = request(512)
    router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()),
                  ("c", Role.BOTH, load(running=40, max_num_seqs=40)), peer_fetch=True)
    cache(router, "a", req, 24)
    cache(router, "c", req, 31)  # c's step with 41 sequences: 184 ms; a's with 9: 56 ms
    assert peer_of(router.route(req)) == ("b", 384, "a")
    router.update_load("c", load(running=8, max_num_seqs=8))  # as full, as quick as a
    assert peer_of(router.route(req)) == ("b", 496, "c")


@pytest.mark.parametrize("slow", ["transfer", "step"])
def test_no_peer_when_recomputing_is_predicted_faster(slow: str) -> None:
    """Gain 512 -> 16 uncached tokens: 331 ms. A 10 MB/s link moves the 496 tokens in
    1.1 s; a holder step with 400 sequences takes 1.6 s. Fast link, small batch: fetched.
    A holder's queue of waiting prompts does not count: it exports between two steps."""
    req = request(512)
    for is_slow in (True, False):
        bandwidth = 1e7 if is_slow and slow == "transfer" else 2e9
        running = 400 if is_slow and slow == "step" else 4
        holder = load(running=running, waiting=4, waiting_tokens=4000, max_num_seqs=512)
        router = make(("a", Role.BOTH, holder), ("b", Role.BOTH, load()),
                      peer_fetch=True, transfer_bandwidth_bytes_s=bandwidth)
        cache(router, "a", req, 32)
        decision = router.route(req)
        assert decision is not None and decision.decode_worker == "b"
        if is_slow:
            assert decision.peer is None and decision.num_cached_tokens == 0
        else:
            assert peer_of(decision) == ("b", 496, "a")


def test_a_prefix_in_the_holders_host_tier_is_fetched_and_its_load_counted() -> None:
    req = request(512)
    router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()), peer_fetch=True)
    fast = TierSpeed(latency_s=0.0002, bytes_per_s=2e9)
    router.tiers.speeds("a").overrides[TierName.HOST] = fast
    router.apply_tier_events("a", TierName.HOST, 1,
                             [BlockStored(tuple(req.block_hashes), None)])
    assert router.index.match(req.block_hashes) == {}  # nothing in any pool
    decision = router.route(req)
    assert peer_of(decision) == ("b", 496, "a")
    assert decision is not None and decision.peer is not None
    tier_load = 31 * fast.block_s(BS * KV_BYTES)
    assert decision.peer.predicted_s == pytest.approx(step(9) + tier_load + fetch_s(496))


def test_the_gain_must_reach_peer_min_blocks() -> None:
    """b holds 30 blocks itself, a 31: one block more. With a slow model (10 ms a token)
    that block is worth fetching, but only where peer_min_blocks allows one."""
    req = request(512)
    slow_model = CostModelConfig(prefill_per_token_s=0.01)
    for min_blocks in (2, 1):
        router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()), peer_fetch=True,
                      peer_min_blocks=min_blocks, cost=slow_model)
        cache(router, "a", req, 32)
        cache(router, "b", req, 30)
        decision = router.route(req)
        assert decision is not None and decision.decode_worker == "b"
        if min_blocks == 2:
            assert decision.peer is None and decision.num_cached_tokens == 480
        else:
            assert peer_of(decision) == ("b", 496, "a")
            assert decision.peer is not None
            # Only the block b lacks crosses the wire.
            assert decision.peer.predicted_s == pytest.approx(step(9) + fetch_s(16))
    with pytest.raises(ValueError, match="peer_min_blocks"):
        RouterConfig(peer_min_blocks=0)


@pytest.mark.parametrize("num_tokens", [497, 512, 520])
def test_a_prompt_that_is_all_prefix_leaves_its_last_token(num_tokens: int) -> None:
    req = request(num_tokens)
    router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()), peer_fetch=True)
    cache(router, "a", req, len(req.block_hashes))
    decision = router.route(req)
    assert peer_of(decision) == ("b", (num_tokens - 1) // BS * BS, "a")
    assert decision is not None and decision.peer is not None
    assert decision.peer.num_tokens < num_tokens


def test_dispatch_books_the_holder_and_finish_drops_both_shares() -> None:
    req = request(512)
    router = make(("a", Role.BOTH, FULL), ("b", Role.BOTH, load()), peer_fetch=True)
    cache(router, "a", req, 20)
    decision = router.route(req)
    assert peer_of(decision) == ("b", 320, "a")
    assert decision is not None
    router.on_dispatched(decision, req)
    a, b = router.worker_state("a"), router.worker_state("b")
    assert a is not None and b is not None
    # The holder holds 20 blocks and computes nothing; b fills 32 new blocks (20 fetched).
    assert a.in_flight == InFlight(kv_blocks=20)
    assert b.in_flight == InFlight(num_waiting=1, num_waiting_tokens=192, kv_blocks=32)
    router.on_finished(req.request_id)
    assert a.in_flight == InFlight() and b.in_flight == InFlight()
    assert a.pending == {} and b.pending == {}


def test_a_remote_prefill_never_carries_a_peer() -> None:
    req = request(2048)
    for disagg in (None, DisaggPolicy.ALWAYS):
        router = make(("p", Role.PREFILL, load()), ("d", Role.DECODE, load(running=30)),
                      ("h", Role.DECODE, FULL), peer_fetch=True)
        cache(router, "h", req, 128)
        req.disagg = disagg
        decision = router.route(req)
        assert decision is not None and decision.prefill_worker == "p"
        assert decision.decode_worker == "d" and decision.peer is None
        assert decision.reason in (RouteReason.REMOTE_FASTER, RouteReason.FORCED_REMOTE)
        assert router.stats().num_peer_fetches == 0
    # The same cluster with a local prefill forced: h's prefix is fetched.
    req.disagg = DisaggPolicy.NEVER
    decision = router.route(req)
    assert peer_of(decision) == ("d", 2032, "h")
    assert decision is not None and decision.reason is RouteReason.FORCED_LOCAL


def test_a_prefill_worker_may_be_the_holder() -> None:
    """Every prefill worker is over budget (PREFILL_POOL_SATURATED): the local decision
    fetches the prefix the saturated prefill worker holds."""
    req = request(512)
    router = make(("p", Role.PREFILL, FULL), ("d", Role.DECODE, load()), peer_fetch=True)
    cache(router, "p", req, 32)
    decision = router.route(req)
    assert peer_of(decision) == ("d", 496, "p")
    assert decision is not None and decision.reason is RouteReason.PREFILL_POOL_SATURATED
    router.on_dispatched(decision, req)
    router.on_finished(req.request_id)
    p = router.worker_state("p")
    assert p is not None and p.in_flight == InFlight()
