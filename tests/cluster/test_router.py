"""Router: cost ranking, prefix locality vs load, budgets, in-flight accounting, event
resync, worker removal, tenants, stats (conditional disaggregation: test_router_disagg.py).

Default cost priors throughout: prefill(t) = 5 ms + t / 1500 s, decode step(n) =
20 ms + 4 ms * n, transfer = 2 ms + t * 23040 B / 2 GB/s; block size 16.
"""
from __future__ import annotations

import pytest

from splitserve.cluster.router.router import (DisaggPolicy, Role, RouteDecision, Router,
                                              RouterConfig, RouteReason, RouteRequest,
                                              WorkerLoad)
from splitserve.kv_cache.block_hash import BlockHash, hash_full_blocks, root_hash
from splitserve.kv_cache.events import BlockStored

FP = "fp-router-test"
BS = 16


def prefill(t: int) -> float:
    return 0.005 + t / 1500


def step(n: int) -> float:
    return 0.02 + 0.004 * n


def transfer(t: int) -> float:
    return 0.002 + t * 23040 / 2e9


def load(running: int = 0, waiting: int = 0, waiting_tokens: int = 0, used: int = 0,
         total: int = 1000, max_num_seqs: int = 64, prefilling: int = 0,
         partial: int = 1) -> WorkerLoad:
    return WorkerLoad(running, waiting, waiting_tokens, used, total, max_num_seqs,
                      prefilling, partial)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i) % 50000 for i in range(num_tokens)]


def request(num_tokens: int, namespace: str | None = None, rid: str = "r",
            tenant: str | None = None, disagg: DisaggPolicy | None = None,
            seed: int = 0) -> RouteRequest:
    hashes = hash_full_blocks(root_hash(FP, namespace), prompt(num_tokens, seed=seed), BS)
    return RouteRequest(rid, hashes, num_tokens, tenant, disagg)


def cache(router: Router, worker_id: str, req: RouteRequest, num_blocks: int,
          seq: int = 0) -> None:
    assert router.apply_events(worker_id, seq,
                               [BlockStored(tuple(req.block_hashes[:num_blocks]), None)])


def make(*workers: tuple[str, Role, WorkerLoad], **config: object) -> Router:
    router = Router(RouterConfig(**config))  # type: ignore[arg-type]
    for worker_id, role, worker_load in workers:
        router.add_worker(worker_id, role, worker_load)
    return router


def dispatch(router: Router, req: RouteRequest) -> RouteDecision:
    """Route `req` and tell the router it was sent as decided."""
    decision = router.route(req)
    assert decision is not None
    router.on_dispatched(decision, req)
    return decision


def local(decision: RouteDecision | None) -> tuple[str, RouteReason, int]:
    assert decision is not None and decision.prefill_worker is None
    return decision.decode_worker, decision.reason, decision.num_cached_tokens


def remote(decision: RouteDecision | None) -> tuple[str, str, RouteReason, int]:
    assert decision is not None and decision.prefill_worker is not None
    return (decision.prefill_worker, decision.decode_worker, decision.reason,
            decision.num_cached_tokens)


def pd(d_load: WorkerLoad | None = None, p_load: WorkerLoad | None = None,
       **config: object) -> Router:
    """One prefill and one decode worker."""
    return make(("p0", Role.PREFILL, p_load or load()), ("d0", Role.DECODE, d_load or load()),
                **config)


# -- aggregated: cost ranking, locality vs load, budgets ---------------------------------------
def test_prefix_hit_wins_when_load_is_equal() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    req = request(80)
    cache(router, "b", req, 4)
    decision = router.route(req)
    assert local(decision) == ("b", RouteReason.AGGREGATED, 64)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(prefill(16) + step(1))
    # Even one block of hit decides between equally loaded workers.
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    cache(router, "b", req, 1)
    assert local(router.route(req)) == ("b", RouteReason.AGGREGATED, 16)


@pytest.mark.parametrize("busy", [load(waiting=1, waiting_tokens=64), load(running=3)])
def test_enough_load_beats_a_small_hit(busy: WorkerLoad) -> None:
    # b's 16-token hit saves 10.7 ms; 64 queued tokens cost 47.7 ms, 3 more running
    # sequences 12 ms of decode step (+ 2.2 ms of stall).
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, busy))
    req = request(80)
    cache(router, "b", req, 1)
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 0)
    # A big enough hit outweighs the same load again: 64 cached tokens save 42.7 ms.
    cache(router, "b", req, 4, seq=1)
    if busy.num_running:
        assert local(router.route(req)) == ("b", RouteReason.AGGREGATED, 64)


def test_cost_ranking_queue_memory_and_budgets() -> None:
    router = make(("a", Role.BOTH, load(waiting=1, waiting_tokens=300)),
                  ("b", Role.BOTH, load(waiting=1, waiting_tokens=100)),
                  ("c", Role.BOTH, load(waiting=1, waiting_tokens=200)))
    assert local(router.route(request(160))) == ("b", RouteReason.AGGREGATED, 0)
    # Memory pressure: b at 99.0% KV usage after placing the prompt pays ~1 s.
    router.update_load("b", load(waiting=1, waiting_tokens=100, used=980))
    assert local(router.route(request(160))) == ("c", RouteReason.AGGREGATED, 0)
    # Over budget: c's KV cannot hold 10 blocks, a has no free sequence slot.
    router.update_load("c", load(used=991))
    router.update_load("a", load(running=60, waiting=4))
    assert local(router.route(request(160))) == ("b", RouteReason.AGGREGATED, 0)
    router.update_load("b", load(used=995))
    assert router.route(request(160)) is None
    # ...but c's 9 cached blocks leave only one block to allocate: it fits again.
    req = request(160)
    cache(router, "c", req, 9)
    assert local(router.route(req)) == ("c", RouteReason.AGGREGATED, 144)


def test_last_block_is_always_recomputed() -> None:
    router = make(("a", Role.BOTH, load()))
    req = request(64)
    cache(router, "a", req, 4)
    decision = router.route(req)
    assert local(decision) == ("a", RouteReason.AGGREGATED, 48)


# -- in-flight accounting --------------------------------------------------------------------
def test_burst_spreads_until_load_reports_arrive() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    placed = []
    for i in range(4):
        placed.append(dispatch(router, request(160, rid=f"r{i}", seed=i)).decode_worker)
    assert placed == ["a", "b", "a", "b"]
    router.on_finished("r0")
    router.on_finished("r2")  # a's share is gone: a is idle again
    assert local(router.route(request(160, seed=9))) == ("a", RouteReason.AGGREGATED, 0)
    # A load report replaces the in-flight tally.
    router.update_load("b", load())
    router.update_load("a", load(waiting=1, waiting_tokens=16))
    assert local(router.route(request(160, seed=9))) == ("b", RouteReason.AGGREGATED, 0)


def test_a_request_stops_counting_when_its_worker_sends_its_last_output() -> None:
    """A report counted r0 running on a; a sent r0's last output, and the next request
    comes before a's next report: a is idle, not still running r0 (b decodes one)."""
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load(running=1, used=5)))
    r0 = request(160, rid="r0")
    assert dispatch(router, r0).decode_worker == "a"
    router.update_load("a", load(running=1, used=11))  # absorbs r0's share
    assert local(router.route(request(160, seed=1)))[0] == "b"  # a looks as busy as b
    router.on_worker_done("a", "r0")
    assert local(router.route(request(160, seed=1)))[0] == "a"
    router.on_finished("r0")  # the frontend retires it: already done, nothing changes
    assert local(router.route(request(160, seed=1)))[0] == "a"
    router.update_load("a", load(used=0))  # a's next report: r0 gone from it too
    assert local(router.route(request(160, seed=1)))[0] == "a"


def test_a_report_taken_before_a_request_arrived_does_not_absorb_it() -> None:
    """r0 goes to a; a's next report was taken before r0 reached it (it does not name r0,
    and counts nothing running): a still counts r0 until a report names it. A report
    that absorbed every pending share made a look idle here, and the next request went
    to a beside r0 instead of to b (the routing e2e test's occasional failure)."""
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load(running=1, used=5)))
    r0 = request(160, rid="r0")
    assert dispatch(router, r0).decode_worker == "a"
    router.update_load("a", load(), received=[])  # in flight when r0 was dispatched
    assert local(router.route(request(160, seed=1)))[0] == "b"
    router.update_load("a", load(running=1, used=10), received=["r0"])
    assert local(router.route(request(160, seed=1)))[0] == "b"  # the report counts it now
    router.on_worker_done("a", "r0")
    assert local(router.route(request(160, seed=1)))[0] == "a"


def test_done_before_any_report_takes_the_share_back() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    assert dispatch(router, request(160, rid="r0")).decode_worker == "a"
    assert local(router.route(request(160, seed=1)))[0] == "b"
    router.on_worker_done("a", "r0")
    assert local(router.route(request(160, seed=1)))[0] == "a"


def test_a_retired_request_without_its_last_output_waits_for_the_report() -> None:
    """Aborted (no last output): the worker drops it from its next report; until then
    the report's count stands."""
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load(running=1)))
    assert dispatch(router, request(160, rid="r0")).decode_worker == "a"
    router.update_load("a", load(running=1, used=11))
    router.on_finished("r0")
    assert local(router.route(request(160, seed=1)))[0] == "b"
    router.on_worker_done("a", "r0")  # a late last output changes nothing either
    assert local(router.route(request(160, seed=1)))[0] == "b"
    router.update_load("a", load())
    assert local(router.route(request(160, seed=1)))[0] == "a"


def test_remote_dispatch_counts_on_both_workers() -> None:
    router = make(("p0", Role.PREFILL, load()), ("p1", Role.PREFILL, load()),
                  ("d0", Role.DECODE, load(running=8)), ("d1", Role.DECODE, load(running=8)))
    req = request(2048, rid="x")
    decision = router.route(req)
    assert remote(decision) == ("p0", "d0", RouteReason.REMOTE_FASTER, 0)
    assert decision is not None
    router.on_dispatched(decision, req)
    assert remote(router.route(request(2048, seed=1))) == (
        "p1", "d1", RouteReason.REMOTE_FASTER, 0)


# -- events, resync, removal -----------------------------------------------------------------
def test_event_gap_is_ignored_until_a_snapshot() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    req = request(80)
    assert router.apply_events("a", 1, [BlockStored(tuple(req.block_hashes[:1]), None)])
    gap = [BlockStored(tuple(req.block_hashes[1:4]), req.block_hashes[0])]
    assert not router.apply_events("a", 3, gap)
    assert not router.apply_events("a", 4, gap)
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 16)
    router.apply_snapshot("a", 4, req.block_hashes[:4])
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 64)
    assert router.apply_events("a", 5, [])


def test_removed_worker_loses_entries_and_late_events() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load(running=1)))
    req = request(80)
    cache(router, "a", req, 4)
    cache(router, "b", req, 2)
    assert router.num_indexed_blocks == 4
    router.remove_worker("a")
    assert router.num_indexed_blocks == 2
    assert router.index.match(req.block_hashes) == {"b": 2}
    assert router.apply_events("a", 1, [BlockStored(tuple(req.block_hashes), None)])
    assert router.index.match(req.block_hashes) == {"b": 2}
    assert router.worker_ids() == ["b"]
    assert local(router.route(req)) == ("b", RouteReason.AGGREGATED, 32)
    router.remove_worker("b")
    assert router.route(req) is None


# -- tenants -------------------------------------------------------------------------------------
def test_tenants_never_share_a_prefix() -> None:
    router = make(("w1", Role.BOTH, load(running=1)), ("w2", Role.BOTH, load()))
    req_a = request(160, namespace="A", tenant="A")
    req_b = request(160, namespace="B", tenant="B", rid="rb")  # the same tokens
    assert req_a.block_hashes[0] != req_b.block_hashes[0]
    cache(router, "w1", req_a, 10)
    assert router.index.match(req_b.block_hashes) == {}
    assert local(router.route(req_b)) == ("w2", RouteReason.AGGREGATED, 0)
    assert local(router.route(req_a)) == ("w1", RouteReason.AGGREGATED, 144)


def test_tenant_cap_returns_evictions() -> None:
    router = make(("w1", Role.BOTH, load()), tenant_max_cached_blocks=3)
    req = request(80, namespace="A", tenant="A")
    decision = router.route(req)
    assert decision is not None
    router.on_dispatched(decision, req)
    cache(router, "w1", req, 5)
    assert router.tenant_blocks("A") == 5
    hashes: list[BlockHash] = req.block_hashes
    assert router.take_evictions() == {"w1": [hashes[4], hashes[3]]}
    assert router.tenant_blocks("A") == 3
    assert router.index.match(hashes) == {"w1": 3}
    assert router.take_evictions() == {}
    uncapped = make(("w1", Role.BOTH, load()))
    uncapped.on_dispatched(decision, req)
    cache(uncapped, "w1", req, 5)
    assert uncapped.tenant_blocks("A") == 5 and uncapped.take_evictions() == {}


# -- stats, Retry-After ------------------------------------------------------------------------
def test_stats_count_decisions() -> None:
    router = pd(load(running=2))
    router.route(request(2048))
    router.route(request(32))
    router.update_load("d0", load(running=64))
    assert router.route(request(32)) is None
    stats = router.stats()
    assert (stats.num_routed, stats.num_unplaced, stats.num_indexed_blocks) == (2, 1, 0)


def test_retry_after_uses_the_finish_rate() -> None:
    now = [0.0]
    router = Router(RouterConfig(), clock=lambda: now[0])
    assert router.retry_after_s(5) == 60.0  # nothing finished yet: no honest estimate
    for t in range(10):
        now[0] = float(t)
        router.on_finished(f"r{t}")
    now[0] = 10.0
    assert router.retry_after_s(5) == pytest.approx(6.0)  # 6 requests at 1 per second
    assert router.retry_after_s(0) == 1.0
    now[0] = 100.0
    assert router.retry_after_s(5) == 60.0


def test_observed_timings_replace_the_prior() -> None:
    router = make(("a", Role.BOTH, load()), ("b", Role.BOTH, load()))
    req = request(160)
    cache(router, "a", req, 2)
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 32)
    sizes = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    for t in sizes:  # b measures twice the prior's speed; a still uses the pooled model
        router.observe_prefill("b", t, 0.0025 + t / 3000)
    decision = router.route(req)
    assert local(decision) == ("a", RouteReason.AGGREGATED, 32)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(0.0025 + 128 / 3000 + step(1))
    for t in sizes:  # a turns out 10x slower than the prior
        router.observe_prefill("a", t, 0.05 + t / 150)
    decision = router.route(req)
    assert local(decision) == ("b", RouteReason.AGGREGATED, 0)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(0.0025 + 160 / 3000 + step(1))


def test_locality_weight_scales_the_prefix_credit() -> None:
    workers = (("a", Role.BOTH, load()), ("b", Role.BOTH, load(running=1)))
    req = request(80)
    router = make(*workers)
    cache(router, "b", req, 4)
    assert local(router.route(req)) == ("b", RouteReason.AGGREGATED, 64)
    router = make(*workers, locality_weight=0.0)  # hits ignored: the idle worker wins
    cache(router, "b", req, 4)
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 0)


def test_a_hit_that_did_not_decide_is_local_faster() -> None:
    router = pd(load())
    req = request(48)
    cache(router, "d0", req, 1)
    assert local(router.route(req)) == ("d0", RouteReason.LOCAL_FASTER, 16)
