"""capacity.prefill_service: a prompt's prefill time over a lognormal prompt-length
distribution (the `--workload-hint PROMPT:OUTPUT:CV` spread), checked against sampling,
and what the spread does to the layout choice."""
from __future__ import annotations

import numpy as np
import pytest

from splitserve.cluster.planner.capacity import (Curves, Demand, fit_agg, fit_disagg,
                                                 prefill_service)
from splitserve.cluster.planner.layout import (Shape, SLOTarget, WorkloadHint, choose_layout,
                                               default_slo, max_rate)
from splitserve.cluster.planner.model import PlannerConfig
from splitserve.cluster.router.cost_model import Quadratic

# A one-thread worker whose attention term is a third of a 2K-token prompt's prefill.
CURVES = Curves(Quadratic(0.02, 0.0015, 4e-7), Quadratic(0.012, 0.0004, 0.0), 64)


def _demand(prompt: float, cv: float | None, rate: float = 0.0) -> Demand:
    return Demand(rate, prompt, 32.0, backlog=0, running=0, interval_s=10.0, prompt_cv=cv)


def test_without_a_spread_the_mean_prompt_stands_for_all() -> None:
    unknown = prefill_service(_demand(800, None), CURVES, 0.9, unknown_cv2=1.0)
    assert unknown.mean_s == unknown.tail_s == pytest.approx(CURVES.prefill_s(800))
    assert unknown.cv2 == 1.0  # the configured stand-in
    fixed = prefill_service(_demand(800, 0.0), CURVES, 0.9, unknown_cv2=1.0)
    assert fixed.mean_s == pytest.approx(CURVES.prefill_s(800))
    assert fixed.tail_s == pytest.approx(CURVES.prefill_s(800))
    assert fixed.cv2 == pytest.approx(0.0, abs=1e-12)  # every prompt the same length


@pytest.mark.parametrize("cv", [0.3, 0.6, 0.9])
def test_moments_and_tail_match_sampled_lognormal_prompts(cv: float) -> None:
    """(At larger cv the sampled S^2 is ruled by a few huge prompts: no yardstick.)"""
    mean = 800.0
    service = prefill_service(_demand(mean, cv), CURVES, 0.9, unknown_cv2=1.0)
    sigma2 = np.log1p(cv * cv)
    lengths = np.random.default_rng(7).lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2),
                                                 2_000_000)
    a, b, c = CURVES.prefill
    times = a + b * lengths + c * lengths ** 2
    assert service.mean_s == pytest.approx(times.mean(), rel=0.01)
    assert service.cv2 == pytest.approx(times.var() / times.mean() ** 2, rel=0.1)
    assert service.tail_s == pytest.approx(np.quantile(times, 0.9), rel=0.01)
    # The quadratic term: the mean prompt's prefill understates the mean prefill.
    assert service.mean_s > CURVES.prefill_s(mean)


def test_a_decode_step_ridden_keeps_the_work_and_dilutes_the_spread() -> None:
    service = prefill_service(_demand(800, 1.0), CURVES, 0.9, unknown_cv2=1.0)
    riding = service.plus(0.5)
    assert riding.mean_s == pytest.approx(service.mean_s + 0.5)
    assert riding.tail_s == pytest.approx(service.tail_s + 0.5)
    variance = service.cv2 * service.mean_s ** 2
    assert riding.cv2 * riding.mean_s ** 2 == pytest.approx(variance)


def test_spread_raises_the_ttft_quantile_and_lowers_the_rate_met() -> None:
    config = PlannerConfig(slo_ttft_s=6.0, slo_tpot_s=0.05, max_workers=2)
    unloaded = [fit_disagg(_demand(800, cv), CURVES, 1, 1, config).ttft_s
                for cv in (0.0, 0.5, 1.0)]
    assert unloaded == sorted(unloaded) and unloaded[0] < unloaded[-1]
    assert unloaded[-1] == pytest.approx(
        prefill_service(_demand(800, 1.0), CURVES, 0.9, 1.0).tail_s)
    loaded = [fit_agg(_demand(800, cv, rate=0.4), CURVES, 2, config).ttft_s
              for cv in (0.0, 0.5, 1.0)]
    assert loaded == sorted(loaded) and loaded[0] < loaded[-1]
    for shape, p, d in ((Shape.AGG, 0, 2), (Shape.DISAGG, 1, 1), (Shape.MIXED, 1, 1)):
        rates = [max_rate(shape, CURVES, p, d, WorkloadHint(800, 32, cv), config)
                 for cv in (None, 0.5, 1.5)]
        assert rates[0] > rates[1] > rates[2] > 0, shape


def test_long_prompts_in_the_tail_favour_the_wider_worker() -> None:
    """One 2-thread worker prefills a prompt in about half the time of a 1-thread one. For
    a TTFT target just above the mean prompt's 1-thread prefill, the mean says one thread
    each is enough; the spread says the p90 prompt needs both threads. (The TPOT target
    leaves room for the three 1.5 s prompts a 32-token decode may collide with on one
    thread: the TTFT decides.)"""
    wide = Curves(Quadratic(0.02, 0.0008, 2.1e-7), Quadratic(0.010, 0.0003, 0.0), 64)
    curves = {1: CURVES, 2: wide}
    slo = SLOTarget(ttft_s=1.3 * CURVES.prefill_s(800), tpot_s=0.2)
    means_only = choose_layout(curves, WorkloadHint(800, 32), slo, cores=2)
    spread = choose_layout(curves, WorkloadHint(800, 32, 1.0), slo, cores=2)
    assert means_only.label == "agg x2"
    assert spread.label == "agg x1" and "prompt cv 1" in spread.reason
    assert spread.threads_per_worker == 2


def test_derived_slo_is_judged_on_the_quantile_prompt() -> None:
    hint = WorkloadHint(800, 32, 1.0)
    tail = prefill_service(hint.demand(0.0, 10.0), CURVES, 0.9, 1.0).tail_s
    assert default_slo({1: CURVES}, hint).ttft_s == pytest.approx(3 * tail)
    assert default_slo({1: CURVES}, WorkloadHint(800, 32)).ttft_s == pytest.approx(
        3 * CURVES.prefill_s(800))


@pytest.mark.parametrize("cv", [-0.1, 10.5])
def test_hint_refuses_a_spread_outside_the_model(cv: float) -> None:
    with pytest.raises(ValueError, match="prompt cv"):
        WorkloadHint(800, 32, cv)
