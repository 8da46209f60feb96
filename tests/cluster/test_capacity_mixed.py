"""capacity.fit_mixed: P prefill + D decode workers under the router's conditional
disaggregation, the decode workers prefilling the share f of prompts that fits their TPOT
budget and costs less locally. Synthetic curves; the equations are in its docstring."""
from __future__ import annotations

import itertools
import math

import pytest

from splitserve.cluster.planner.capacity import (Curves, Demand, fit_agg, fit_disagg,
                                                 fit_mixed, local_share)
from splitserve.cluster.planner.queueing import Service, mean_wait
from splitserve.cluster.planner.layout import Shape, WorkloadHint, max_rate
from splitserve.cluster.planner.model import PlannerConfig
from splitserve.cluster.router.config import RouterConfig
from splitserve.cluster.router.cost_model import Quadratic

# One single-thread worker: ~0.3 s for 384 tokens, a 20 ms decode step at batch 1.
CURVES = Curves(Quadratic(0.02, 0.0006, 1e-7), Quadratic(0.018, 0.002, 0.0), 64)
CHEAP = Curves(Quadratic(0.002, 0.00005, 0.0), Quadratic(0.018, 0.002, 0.0), 64)
WINDOW = RouterConfig().tpot_window_tokens


def _config(ttft_s: float, tpot_s: float) -> PlannerConfig:
    return PlannerConfig(slo_ttft_s=ttft_s, slo_tpot_s=tpot_s, max_workers=4)


def _demand(rate: float, prompt: int, output: int, running: int = 0) -> Demand:
    return Demand(rate, float(prompt), float(output), backlog=0, running=running,
                  interval_s=10.0)


def test_cheap_prefill_goes_all_local_with_the_colocated_tpot() -> None:
    """A 128-token prompt costs the decode worker 8 ms: at a light load every prompt is
    prefilled locally, and the decode worker's TPOT is a colocated worker's mean one
    (the router's TPOT rule bounds each request's stall, so it is no worse than agg's
    quantile, which nothing bounds)."""
    config = _config(1.0, 0.05)
    demand = _demand(0.5, 128, 64)
    assert local_share(demand, CHEAP, 1, 1, config) == 1.0
    mixed = fit_mixed(demand, CHEAP, 1, 1, config)
    agg = fit_agg(demand, CHEAP, 1, config)
    step, rho = CHEAP.step_s(math.ceil(demand.sequences(0.05))), 0.5 * CHEAP.prefill_s(128)
    assert mixed.tpot_s == pytest.approx(step / (1 - rho))
    assert mixed.tpot_s <= agg.tpot_s
    assert mixed.tpot_s > fit_disagg(demand, CHEAP, 1, 1, config).tpot_s  # it prefills
    assert mixed.ttft_s == pytest.approx(agg.ttft_s)  # and nothing waits on the P worker


def test_mixed_beats_disagg_where_the_prefill_pool_is_the_bottleneck() -> None:
    """Short outputs, long-ish prompts, a TPOT target with room: the decode worker's spare
    time prefills what the prefill worker cannot."""
    config = _config(3.0, 0.04)
    hint = WorkloadHint(256, 8)
    mixed = max_rate(Shape.MIXED, CURVES, 1, 1, hint, config)
    disagg = max_rate(Shape.DISAGG, CURVES, 1, 1, hint, config)
    assert mixed > 1.15 * disagg
    at = _demand(mixed, 256, 8)
    assert 0 < local_share(at, CURVES, 1, 1, config) < 1  # long queues spill both ways


@pytest.mark.parametrize("prompt", [128, 512, 1536])
def test_no_tpot_slack_is_disagg_exactly(prompt: int) -> None:
    """The router's rule: step + (recent + S) / W <= TPOT target. With the target at the
    step plus one prompt's stall there is no room for any local prefill."""
    demand = _demand(0.2, prompt, 64)
    step = CURVES.step_s(1)  # 0.2 req/s * 64 tokens * ~0.05 s: one sequence per worker
    edge = step + CURVES.prefill_s(prompt) / WINDOW
    for tpot in (step, edge * (1 - 1e-9)):
        config = _config(5.0, tpot)
        assert local_share(demand, CURVES, 1, 1, config) == 0.0
        assert fit_mixed(demand, CURVES, 1, 1, config) == fit_disagg(demand, CURVES, 1, 1,
                                                                     config)
    # Just past the edge some local prefill fits, and the TPOT stays within the target.
    config = _config(5.0, edge * 1.05)
    assert local_share(demand, CURVES, 1, 1, config) > 0
    assert fit_mixed(demand, CURVES, 1, 1, config).tpot_s <= edge * 1.05
    # A decode worker pacing its steps at a pace above the step gives its sequences a
    # token per pace: the same prompt no longer fits.
    paced = step + 0.1 * edge  # over the 5% of slack
    assert local_share(demand, CURVES, 1, 1, config, pace_s=paced) == 0.0
    assert fit_mixed(demand, CURVES, 1, 1, config, pace_s=paced) == fit_disagg(
        demand, CURVES, 1, 1, config)
    assert local_share(demand, CURVES, 1, 1, config, pace_s=step / 2) > 0  # below: no effect


def test_a_busy_decode_worker_keeps_prompts_remote_until_the_prefill_pool_queues() -> None:
    """The cost rule: a local prefill stalls n running sequences (n S / W); remote costs
    the transfer and the prefill pool's wait. With 48 sequences running, a light load
    stays remote; near the prefill worker's capacity its queue makes local cheaper."""
    config = _config(10.0, 0.5)
    service = CURVES.prefill_s(512)
    light = _demand(0.1, 512, 16, running=48)
    assert local_share(light, CURVES, 1, 1, config) == 0.0
    heavy = _demand(0.95 / service, 512, 16, running=48)
    share = local_share(heavy, CURVES, 1, 1, config)
    assert 0 < share < 1
    # At that share the local side's wait and stall meet the remote wait and transfer.
    stall = 48 * service / WINDOW
    prompt = Service(service, config.service_cv2, service)
    local = mean_wait(share * heavy.rate, prompt.plus(CURVES.step_s(48)), 1, config)
    remote = mean_wait((1 - share) * heavy.rate, prompt, 1, config)
    assert local + stall == pytest.approx(remote + 0.002 + 512 * 23040 / 2e9, rel=1e-3)


CASES = list(itertools.product([128, 512, 1536], [16, 128], [(1.0, 0.03), (4.0, 0.05),
                                                          (4.0, 0.1), (2.0, 0.2)],
                               [(1, 1), (1, 2), (2, 1)]))


@pytest.mark.parametrize("prompt, output, slo, counts", CASES)
def test_mixed_serves_at_least_what_disagg_does(prompt: int, output: int,
                                                slo: tuple[float, float],
                                                counts: tuple[int, int]) -> None:
    config = _config(*slo)
    hint = WorkloadHint(prompt, output)
    disagg = max_rate(Shape.DISAGG, CURVES, *counts, hint, config)
    assert max_rate(Shape.MIXED, CURVES, *counts, hint, config) >= disagg * (1 - 1e-9)


@pytest.mark.parametrize("prompt, output, slo, counts", CASES[::3])
def test_meeting_the_slos_is_monotone_in_the_rate(prompt: int, output: int,
                                                  slo: tuple[float, float],
                                                  counts: tuple[int, int]) -> None:
    """max_rate bisects: a rate that meets the targets must have every lower rate meet
    them too; and the prefill pool never gets less work as the rate grows."""
    config = _config(*slo)
    met, remote_before = True, 0.0
    for i in range(1, 300):
        demand = _demand(i * 0.02, prompt, output)
        fit = fit_mixed(demand, CURVES, *counts, config)
        meets = fit.ttft_s <= slo[0] and fit.tpot_s <= slo[1]
        assert met or not meets, f"meets at {demand.rate} req/s but not below"
        met = meets
        remote = (1 - local_share(demand, CURVES, *counts, config)) * demand.rate
        assert remote >= remote_before - 1e-9
        remote_before = remote
        if not math.isinf(fit.tpot_s) and local_share(demand, CURVES, *counts, config) > 0:
            assert fit.tpot_s <= slo[1]


def test_agg_tpot_is_a_requests_at_the_quantile_not_the_mean() -> None:
    """Table (a)'s shape: 1.5K prompts (~2.5 s to prefill on a worker), 100 output tokens
    at 16.5 ms. At 0.0625 req/s on 2 workers the prefill share is ~8%, so the mean TPOT
    (17.9 ms) meets 25 ms; but more than 10% of requests decode while their worker
    prefills a prompt, and one such prompt adds 25 ms to their TPOT: agg misses a 25 ms
    TPOT and meets 100 ms (both measured: docs/benchmarks.md, goodput (a))."""
    curves = Curves(Quadratic(0.0, 2.5 / 1549, 0.0), Quadratic(0.0165, 0.0, 0.0), 64)
    demand = _demand(0.0625, 1549, 100)
    strict, loose = _config(12.5, 0.025), _config(8.0, 0.1)
    mean = 0.0165 / (1 - 0.0625 * 2.5 / 2)
    assert mean < 0.025
    assert fit_agg(demand, curves, 2, strict).tpot_s == pytest.approx(0.0165 + 2.5 / 100)
    assert fit_agg(demand, curves, 2, loose).tpot_s < 0.1
    assert fit_disagg(demand, curves, 1, 1, strict).tpot_s == pytest.approx(0.0165)
    # at a vanishing rate no request collides: the mean is the quantile
    assert fit_agg(_demand(0.001, 1549, 100), curves, 2, strict).tpot_s == pytest.approx(
        0.0165 / (1 - 0.001 * 2.5 / 2))


def test_agg_tpot_counts_the_prompts_that_arrive_while_a_request_prefills() -> None:
    """Goodput (a) zen3-avx2-v3 (docs/benchmarks.md; 1,549 + 100 tokens, prompt cv 0.19,
    TPOT 100 ms): agg x1 (2 threads, these measured curves) served a p90 TPOT of 106 ms at
    0.0884 req/s and 158 ms at 0.177. The former count (arrivals over the decode alone, ~1
    s) predicted 47 ms and 123 ms, and --mode auto chose agg x1 over disagg (which held
    0.177). A request's wait and prefill (~4 s) are most of its exposure: now 80-100 ms at
    0.0884 and more than 100 ms at 0.125, where disagg still meets it."""
    curves = Curves(Quadratic(0.01948, 0.0014086, 5.303e-7), Quadratic(0.00773, 0.00229, 0.0),
                    64, decode_per_context_s=5.64e-7, context_tokens=1549 + 50)
    config = _config(16.0, 0.1)

    def demand(rate: float) -> Demand:
        return Demand(rate, 1549.0, 100.0, 0, 0, 10.0, prompt_cv=0.19)
    assert 0.08 <= fit_agg(demand(0.0884), curves, 1, config).tpot_s <= 0.1
    assert fit_agg(demand(0.125), curves, 1, config).tpot_s > 0.1
    assert fit_agg(demand(0.177), curves, 1, config).tpot_s > 0.158
    # the same traffic without its prefills would collide with nothing: its step alone
    short = Demand(0.0884, 1.0, 100.0, 0, 0, 10.0)
    assert fit_agg(short, curves, 1, config).tpot_s < 0.015
