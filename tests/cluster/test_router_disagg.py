"""Router, conditional disaggregation: local vs remote prefill by predicted TTFT, the KV
layout the transfer cost uses, TPOT budgets, forced and per-request policies, choosing
the prefill worker, and the queue-wait formula both placements rank by. Helpers and cost
priors: test_router.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from splitserve.cluster.router.router import (DisaggPolicy, KVLayout, Role, Router,
                                              RouterConfig, RouteReason, RouteRequest)
from splitserve.kv_cache.block_hash import hash_full_blocks, root_hash

from test_router import (BS, FP, cache, dispatch, load, local, make, pd, prefill, prompt,
                         remote, request, step, transfer)


def test_short_prompt_stays_local() -> None:
    router = pd(load(running=2))
    decision = router.route(request(32))
    assert local(decision) == ("d0", RouteReason.LOCAL_FASTER, 0)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(prefill(32) + step(3))


def test_long_uncached_prompt_goes_remote() -> None:
    router = pd(load(running=8))
    decision = router.route(request(2048))
    assert remote(decision) == ("p0", "d0", RouteReason.REMOTE_FASTER, 0)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(prefill(2048) + transfer(2048) + step(9))


def test_kv_layout_comes_from_the_workers() -> None:
    router = pd(load(running=8))
    # Twice the bytes per token: twice the wire time (2 ms latency + 2 * 23.6 ms).
    router.set_kv_layout(KVLayout(block_size=BS, kv_bytes_per_token=2 * 23040))
    decision = router.route(request(2048))
    assert decision is not None and decision.prefill_worker == "p0"
    assert decision.predicted_s == pytest.approx(prefill(2048) + 2 * transfer(2048) - 0.002
                                                 + step(9))
    # Blocks of 32: a 40-token prompt's one full block is cached, the last token recomputed.
    router = make(("a", Role.BOTH, load()))
    router.set_kv_layout(KVLayout(block_size=32))
    req = RouteRequest("r", hash_full_blocks(root_hash(FP, None), prompt(40), 32), 40)
    cache(router, "a", req, 1)
    assert local(router.route(req)) == ("a", RouteReason.AGGREGATED, 32)
    with pytest.raises(ValueError, match="block_size=0"):
        KVLayout(block_size=0)


def test_high_prefix_hit_on_the_decode_worker_stays_local() -> None:
    router = pd(load(running=8))
    req = request(2048)
    cache(router, "d0", req, 128)
    decision = router.route(req)
    assert local(decision) == ("d0", RouteReason.LOCAL_PREFIX_HIT, 2032)
    assert decision is not None
    assert decision.predicted_s == pytest.approx(prefill(16) + step(9))


def test_saturated_prefill_pool_prefills_locally() -> None:
    router = pd(load(running=8), load(running=4, waiting=4, max_num_seqs=8))
    assert local(router.route(request(2048))) == (
        "d0", RouteReason.PREFILL_POOL_SATURATED, 0)


def test_tpot_budget_forces_remote() -> None:
    # Local is 2.2 ms cheaper, but the stall lifts d0's running sequence to
    # step(2) + prefill(256) / 64 = 30.7 ms per token.
    assert local(pd(load(running=1)).route(request(256))) == (
        "d0", RouteReason.LOCAL_FASTER, 0)
    router = pd(load(running=1), tpot_slo_s=0.030)
    assert remote(router.route(request(256))) == ("p0", "d0", RouteReason.TPOT_BUDGET, 0)
    # An idle decode worker too: sequences that arrive during the prefill would stall.
    router = pd(load(), tpot_slo_s=0.026)
    assert remote(router.route(request(256))) == ("p0", "d0", RouteReason.TPOT_BUDGET, 0)
    assert local(router.route(request(32))) == ("d0", RouteReason.LOCAL_FASTER, 0)


def test_a_pacing_decode_worker_gives_a_token_per_pace_before_any_stall() -> None:
    # Within 40 ms unpaced: step(2) + prefill(256) / 64 = 30.7 ms. Paced at 38 ms (it lends
    # its core between steps, cluster/worker/lending.py): 38 + 2.7 ms is over the budget.
    assert local(pd(load(running=1), tpot_slo_s=0.040).route(request(256))) == (
        "d0", RouteReason.LOCAL_FASTER, 0)
    router = pd(replace(load(running=1), pace_s=0.038), tpot_slo_s=0.040)
    assert remote(router.route(request(256))) == ("p0", "d0", RouteReason.TPOT_BUDGET, 0)
    assert local(router.route(request(32))) == ("d0", RouteReason.LOCAL_FASTER, 0)


def test_a_borrowing_prefill_workers_steps_are_not_pooled() -> None:
    """A prefill worker computing on the decode worker's core too (WorkerReady.borrows_cores)
    is faster than the decode worker alone: the decode worker, unfitted, keeps its prior
    rather than the pool of such steps."""
    for borrows, expected in ((True, prefill(1024)), (False, 0.005 + 1024 / 3000)):
        router = pd(p_load=replace(load(), borrows_cores=borrows))
        for t in range(64, 1088, 64):
            router.observe_prefill("p0", t, 0.005 + t / 3000)  # twice the prior's speed
        d0 = router.worker_state("d0")
        assert d0 is not None
        assert d0.prefill_model.predict(1024) == pytest.approx(expected)


def test_tpot_budget_counts_the_local_prefills_of_the_horizon() -> None:
    # One 256-token local prefill fits d0's budget: step(2) + prefill(256) / 64 = 30.7 ms
    # <= 40 ms. Together, the ones routed within the horizon (64 tokens x 40 ms = 2.56 s)
    # stall the same running sequence: only floor((40 - 28) ms * 64 / prefill(256)) = 4 fit.
    now = [0.0]
    router = Router(RouterConfig(tpot_slo_s=0.040), clock=lambda: now[0])
    router.add_worker("p0", Role.PREFILL, load())
    router.add_worker("d0", Role.DECODE, load(running=1))
    places = []
    for i in range(6):
        decision = dispatch(router, request(256, rid=f"r{i}", seed=i))
        router.update_load("d0", load(running=1))  # its prefill is done, it decodes on
        router.update_load("p0", load())
        places.append(decision.reason)
        now[0] += 0.1
    assert places == [RouteReason.LOCAL_FASTER] * 4 + [RouteReason.TPOT_BUDGET] * 2
    now[0] += 2.56  # the horizon passed: those prefills no longer hold anybody up
    assert local(router.route(request(256, seed=9))) == ("d0", RouteReason.LOCAL_FASTER, 0)


def test_forced_policies_and_per_request_override() -> None:
    router = pd(load(running=8), disagg="never")
    assert router.config.policy == DisaggPolicy.NEVER
    assert local(router.route(request(2048))) == ("d0", RouteReason.FORCED_LOCAL, 0)
    router = pd(load(), disagg=DisaggPolicy.ALWAYS)
    assert remote(router.route(request(32))) == ("p0", "d0", RouteReason.FORCED_REMOTE, 0)
    req = request(32, disagg=DisaggPolicy.AUTO)
    assert local(router.route(req)) == ("d0", RouteReason.LOCAL_FASTER, 0)
    # ALWAYS never falls back to a local prefill: the caller queues instead.
    router = pd(load(), load(running=8, max_num_seqs=8), disagg="always")
    assert router.route(request(32)) is None
    with pytest.raises(ValueError, match="sometimes"):
        RouterConfig(disagg="sometimes")


def test_per_request_policy_overrides_the_configured_one_for_that_request() -> None:
    router = pd(load())  # AUTO: a short prompt stays local
    assert remote(router.route(request(32, disagg=DisaggPolicy.ALWAYS))) == (
        "p0", "d0", RouteReason.FORCED_REMOTE, 0)
    assert local(router.route(request(32))) == ("d0", RouteReason.LOCAL_FASTER, 0)
    router = pd(load(running=8), disagg="always")  # a long prompt would go remote anyway
    assert local(router.route(request(2048, disagg=DisaggPolicy.NEVER))) == (
        "d0", RouteReason.FORCED_LOCAL, 0)
    assert remote(router.route(request(2048)))[2] == RouteReason.FORCED_REMOTE
    # The impossible is refused: with no prefill worker up, ALWAYS prefills locally...
    router.remove_worker("p0")
    assert local(router.route(request(32, disagg=DisaggPolicy.ALWAYS))) == (
        "d0", RouteReason.AGGREGATED, 0)
    # ...and with every prefill worker over budget it waits, as the configured ALWAYS does.
    router = pd(load(), load(running=8, max_num_seqs=8))
    assert router.route(request(32, disagg=DisaggPolicy.ALWAYS)) is None
    assert local(router.route(request(32))) == ("d0", RouteReason.PREFILL_POOL_SATURATED, 0)


def test_prefill_worker_chosen_by_its_prefix_hit_and_queue() -> None:
    router = make(("p0", Role.PREFILL, load()), ("p1", Role.PREFILL, load()),
                  ("d0", Role.DECODE, load(running=8)), ("d1", Role.BOTH, load(running=9)))
    req = request(2048)
    cache(router, "p1", req, 64)
    assert remote(router.route(req)) == ("p1", "d0", RouteReason.REMOTE_FASTER, 1024)
    # p1's queue (2048 tokens, 1.37 s) outweighs its hit (0.68 s).
    router.update_load("p1", load(waiting=1, waiting_tokens=2048))
    assert remote(router.route(req)) == ("p0", "d0", RouteReason.REMOTE_FASTER, 0)
    # A decode worker without room is skipped; the BOTH worker decodes instead.
    router.update_load("d0", load(running=64))
    assert remote(router.route(req)) == ("p0", "d1", RouteReason.REMOTE_FASTER, 0)


def test_a_prompt_in_prefill_is_queued_work() -> None:
    # p0 reports nothing waiting but a 3000-token prompt halfway through its chunked
    # prefill (1500 tokens left): it is not idle.
    router = make(("p0", Role.PREFILL, load(waiting_tokens=1500, prefilling=1)),
                  ("p1", Role.PREFILL, load()), ("d0", Role.DECODE, load()),
                  disagg=DisaggPolicy.ALWAYS)
    assert remote(router.route(request(1000)))[:2] == ("p1", "d0")


def test_queue_counts_what_a_shared_step_computes_beside_the_prompt() -> None:
    # p0 shares its steps between 2 prompts and has a long one in prefill: a 200-token
    # prompt waits only for the 200 tokens the long one computes beside it (0.138 s).
    # p1 serves first come first served with a 600-token prompt queued (0.405 s).
    router = make(("p0", Role.PREFILL, load(waiting_tokens=3000, prefilling=1, partial=2)),
                  ("p1", Role.PREFILL, load(waiting=1, waiting_tokens=600)),
                  ("d0", Role.DECODE, load()), disagg=DisaggPolicy.ALWAYS)
    decision = router.route(request(200))
    assert remote(decision)[:2] == ("p0", "d0")
    assert decision is not None
    assert decision.predicted_s == pytest.approx(2 * prefill(200) + transfer(200) + step(1))
    # Served one at a time, p0's 3000 tokens (2.0 s) come first: p1 is faster.
    router.update_load("p0", load(waiting_tokens=3000, prefilling=1, partial=1))
    assert remote(router.route(request(200)))[:2] == ("p1", "d0")


def test_queue_wait_formula() -> None:
    from splitserve.cluster.router.scoring import queue_wait
    a, b, c = (np.array([v]) for v in (0.005, 1 / 1500, 0.0))
    wait = lambda seqs, tokens, slots, u: float(queue_wait(  # noqa: E731
        a, b, c, np.array([seqs]), np.array([tokens]), np.array([slots]), np.array([u]))[0])
    assert wait(0, 0, 1, 100) == 0.0
    assert wait(3, 3000, 0, 200) == pytest.approx(3 * prefill(1000))  # one at a time
    assert wait(3, 3000, 1, 200) == pytest.approx(prefill(200) + 2 * prefill(1000))
    assert wait(3, 3000, 4, 5000) == pytest.approx(3 * prefill(1000))  # longer than them
