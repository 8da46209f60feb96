"""`--mode auto`: choose_layout on synthetic cost curves, and resolve_layout's handling of
what the operator fixed (no engine here: the curves source is a stand-in)."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.cluster import launcher as launcher_mod
from splitserve.cluster.launcher import Cluster
from splitserve.cluster.specs import worker_specs
from splitserve.cluster.planner import layout as layout_mod
from splitserve.cluster.planner.auto_layout import (publish_layout, resolve_layout,
                                                    router_costs, router_tpot_slo_s)
from splitserve.cluster.planner.capacity import Curves, Demand, fit_at, local_share
from splitserve.cluster.planner.layout import (Shape, SLOTarget, WorkloadHint,
                                               candidate_shapes, candidate_threads,
                                               choose_layout)
from splitserve.cluster.planner.model import Layout, PlannerConfig
from splitserve.cluster.planner.profile import CostCurves
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.config import DisaggPolicy
from splitserve.cluster.router.cost_model import (CostModelConfig, DecodeStepModel,
                                                  PrefillCostModel, Quadratic)
from splitserve.cluster.runtime.base import WorkerSpec
from splitserve.cluster.runtime.local import LocalRuntime
from splitserve.config import ServeConfig
from splitserve.errors import LayoutProfileError

# One worker's curves at 1 and 2 threads: two threads prefill ~1.5x faster and barely
# speed a (memory-bound) decode step up.
PREFILL_1 = Quadratic(0.02, 0.0006, 1e-7)  # ~1.2 s for 1536 tokens
DECODE_1 = Quadratic(0.018, 0.002, 0.0)  # 20 ms at batch 1
PREFILL_2 = Quadratic(0.015, 0.0004, 7e-8)
DECODE_2 = Quadratic(0.016, 0.0015, 0.0)
CURVES = {1: Curves(PREFILL_1, DECODE_1, 64), 2: Curves(PREFILL_2, DECODE_2, 64)}


def test_candidates_split_the_cores_evenly() -> None:
    assert candidate_shapes(2) == [(Shape.AGG, 0, 1, 2), (Shape.AGG, 0, 2, 1),
                                   (Shape.DISAGG, 1, 1, 1), (Shape.MIXED, 1, 1, 1)]
    assert candidate_threads(2) == [1, 2]
    assert candidate_threads(16) == [1, 2, 4, 8, 16]
    assert candidate_shapes(1) == [(Shape.AGG, 0, 1, 1)]
    # --threads-per-worker 2 on 4 cores: at most two workers, two threads each
    assert candidate_shapes(4, threads_per_worker=2) == [
        (Shape.AGG, 0, 1, 2), (Shape.AGG, 0, 2, 2), (Shape.DISAGG, 1, 1, 2),
        (Shape.MIXED, 1, 1, 2)]
    # Each kind's workers (the planner's Layout) and router policy.
    assert [(k.layout, k.disagg_policy) for k in Shape] == [
        (Layout.AGG, "never"), (Layout.DISAGG, "always"), (Layout.DISAGG, "auto")]


def test_a_borrowing_prefill_worker_is_scored_on_the_cores_it_gets() -> None:
    """The prefill worker borrows the decode core (cluster/specs.py): unloaded it prefills
    at two threads; the busier the decode worker, the closer to its own core's speed."""
    from splitserve.cluster.planner.layout import borrowing_curves, decode_busy, lent_threads
    assert [lent_threads(*c) for c in ((1, 1, 1), (1, 3, 1), (2, 2, 1), (1, 1, 2),
                                       (2, 1, 1), (3, 1, 1))] == [2, 4, 2, 4, None, None]
    hint = WorkloadHint(1536, 96)
    busy = [decode_busy(CURVES[1], hint, rate, 1) for rate in (0.0, 0.1, 1.0, 100.0)]
    assert busy[0] == 0 and busy == sorted(busy) and 0 < busy[1] < busy[2] < busy[3] <= 1
    mid = borrowing_curves(CURVES[1], CURVES[2], 0.25).prefill
    assert mid.b == pytest.approx(0.75 * PREFILL_2.b + 0.25 * PREFILL_1.b)
    slo = SLOTarget(4.0, 0.1)
    plain, lent = (choose_layout(CURVES, hint, slo, cores=2, borrow=b) for b in (False, True))
    rates = [{c.label: c for c in choice.candidates} for choice in (plain, lent)]
    for label in ("disagg 1P+1D", "mixed 1P+1D"):
        assert rates[1][label].max_rate > rates[0][label].max_rate, label
    assert rates[0]["disagg 1P+1D"].unloaded.ttft_s == pytest.approx(PREFILL_1(1536))
    assert rates[1]["disagg 1P+1D"].unloaded.ttft_s == pytest.approx(PREFILL_2(1536))
    assert rates[1]["agg x2"] == rates[0]["agg x2"]  # colocated workers borrow nothing
    # A pacing decode worker (cluster/worker/lending.py) computes a step of each pace:
    # it leaves the prefill more of the lent core, the more so the longer the pace.
    paced = [decode_busy(CURVES[1], hint, 1.0, 1, pace) for pace in (None, 0.04, 0.08)]
    assert paced[0] > paced[1] > paced[2] > 0
    assert decode_busy(CURVES[1], hint, 1.0, 1, 1e-4) == paced[0]  # below a step: no pace
    both = choose_layout(CURVES, hint, slo, cores=2, borrow=True, pace_s=0.08)
    rates.append({c.label: c for c in both.candidates})
    assert rates[2]["disagg 1P+1D"].max_rate > rates[1]["disagg 1P+1D"].max_rate
    # Its sequences get a token per pace: less of the TPOT target is left for local
    # prefills (the router's rule), so mixed is closer to disagg, never below it.
    assert (rates[2]["disagg 1P+1D"].max_rate <= rates[2]["mixed 1P+1D"].max_rate
            < rates[1]["mixed 1P+1D"].max_rate)
    assert rates[2]["agg x2"] == rates[0]["agg x2"]
    # Threads fixed by hand: nothing is lent (as cluster/specs.py), nothing modeled.
    fixed = choose_layout(CURVES, hint, slo, cores=2, threads_per_worker=1, borrow=True)
    assert fixed == choose_layout(CURVES, hint, slo, cores=2, threads_per_worker=1)


def test_prompt_heavy_with_a_strict_tpot_goes_to_a_prefill_pool() -> None:
    """A 1536-token prompt stalls a colocated worker's decodes for over a second: with a
    TPOT target just above the batch-1 step, only a decode pool of its own meets it. No
    local prefill fits that target (mixed == disagg): within 10%, mixed wins."""
    hint = WorkloadHint(1536, 128)
    strict = choose_layout(CURVES, hint, SLOTarget(4.0, 0.022), cores=2)
    assert (strict.layout, strict.num_prefill, strict.num_decode) == (Layout.DISAGG, 1, 1)
    assert strict.shape is Shape.MIXED and strict.label == "mixed 1P+1D"
    assert strict.disagg_policy == "auto" and strict.threads_per_worker == 1
    rates = {c.label: c.max_rate for c in strict.candidates}
    assert rates["disagg 1P+1D"] > max(rates["agg x2"], rates["agg x1 (2 threads)"]) / 0.9
    assert rates["mixed 1P+1D"] == rates["disagg 1P+1D"]
    assert strict.reason.startswith("mixed 1P+1D: 0.35 req/s vs disagg 1P+1D 0.35 req/s, ")
    assert "TTFT 4000 ms / TPOT 22 ms (p90) for 1536+128-token requests" in strict.reason
    assert "within 10% of disagg 1P+1D: mixed" in strict.reason
    # The same machine and prompts with a loose TPOT: two colocated workers serve more.
    loose = choose_layout(CURVES, hint, SLOTarget(4.0, 0.1), cores=2)
    assert (loose.layout, loose.num_decode, loose.disagg_policy) == (Layout.AGG, 2, "never")


def test_a_long_context_makes_colocated_decodes_miss_a_strict_tpot() -> None:
    """Goodput table (a) zen4-derived (1,549 + 100 tokens, TTFT 9.7 s, TPOT 21 ms): this
    VM's curves without the context term predicted agg x1 (2 threads) a 6.6 ms step, room
    for one long prefill in a request's TPOT, and chose it; served, its step at ~2K tokens
    of context was ~14 ms and agg x1 held 90% only at 0.0625 req/s against disagg's 0.25.
    With the context term (~3.5 us per token per sequence, this VM) agg x1's rate falls by
    3x and disagg or mixed wins. (Without it they win too since fit_agg counts the prompts
    that arrive while a request waits and prefills: agg x1 0.18 req/s, disagg 0.26.)"""
    per_context = 3.5e-6
    curves = {1: Curves(Quadratic(0.0122, 0.00096, 3.54e-7), Quadratic(0.0058, 0.00136, 0.0),
                        64),
              2: Curves(Quadratic(0.0086, 0.00048, 1.76e-7), Quadratic(0.0059, 0.00072, 0.0),
                        64)}
    hint, slo = WorkloadHint(1549, 100, 0.21), SLOTarget(9.729, 0.021)
    blind = choose_layout(curves, hint, slo, 2)
    aware = {t: c._replace(decode_per_context_s=per_context) for t, c in curves.items()}
    choice = choose_layout(aware, hint, slo, 2)
    assert choice.shape in (Shape.DISAGG, Shape.MIXED), choice.reason
    [agg1] = [c for c in choice.candidates if c.shape is Shape.AGG and c.num_decode == 1]
    [blind1] = [c for c in blind.candidates if c.shape is Shape.AGG and c.num_decode == 1]
    assert agg1.max_rate < blind1.max_rate / 2
    assert agg1.unloaded.tpot_s == pytest.approx(aware[2].decode(1) + 1599 * per_context,
                                                 rel=0.01)  # the step at 1,549 + 100 / 2
    # Short prompts: the context adds little, the choice stays colocated.
    short = WorkloadHint(128, 128)
    assert choose_layout(aware, short, SLOTarget(1.0, 0.08), 2).shape is Shape.AGG


def test_prefill_bound_traffic_with_room_under_tpot_goes_mixed() -> None:
    """384-token prompts, 16-token outputs, TPOT 40 ms: the prefill worker is the
    bottleneck of disagg, a colocated worker's prefills break the TPOT target early, and
    the decode worker has room to prefill a share of the prompts itself."""
    config = PlannerConfig(slo_ttft_s=6.0, slo_tpot_s=0.04, max_workers=2)
    choice = choose_layout(CURVES, WorkloadHint(384, 16), SLOTarget(6.0, 0.04), cores=2)
    assert (choice.shape, choice.num_prefill, choice.num_decode) == (Shape.MIXED, 1, 1)
    assert choice.layout is Layout.DISAGG and choice.disagg_policy == "auto"
    rates = {c.label: c.max_rate for c in choice.candidates}
    others = [r for label, r in rates.items() if label != "mixed 1P+1D"]
    assert rates["mixed 1P+1D"] > max(others) / 0.9 and "within" not in choice.reason
    assert choice.reason.startswith("mixed 1P+1D: 4.5 req/s vs ")
    # At that rate the decode worker prefills part of the prompts, not all nor none.
    at = Demand(rates["mixed 1P+1D"], 384, 16, 0, 0, 10.0)
    assert 0 < local_share(at, CURVES[1], 1, 1, config) < 1
    assert choice.to_dict()["layout"] == "mixed"

def test_short_prompts_with_fast_prefill_stay_colocated() -> None:
    fast = {1: Curves(Quadratic(0.005, 0.0002, 0), DECODE_1, 64),
            2: Curves(Quadratic(0.004, 0.00013, 0), DECODE_2, 64)}
    choice = choose_layout(fast, WorkloadHint(128, 128), SLOTarget(1.0, 0.08), cores=2)
    assert (choice.layout, choice.num_prefill, choice.num_decode) == (Layout.AGG, 0, 2)
    assert choice.label == "agg x2" and choice.reason.startswith("agg x2: ")
    assert choice.shape is Shape.AGG and choice.disagg_policy == "never"
    best = max(choice.candidates, key=lambda c: c.max_rate)
    assert best.label == "agg x2" and "within" not in choice.reason
    # The rate is where the model's predictions cross the targets.
    config = PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.08, max_workers=2)

    def fit(rate: float) -> tuple[float, float]:
        return fit_at(Layout.AGG, Demand(rate, 128, 128, 0, 0, 10.0), fast[1], 0, 2, config)

    below, above = fit(best.max_rate * 0.999), fit(best.max_rate * 1.01)
    assert below[0] <= 1.0 and below[1] <= 0.08
    assert above[0] > 1.0 or above[1] > 0.08


def test_one_core_is_one_colocated_worker() -> None:
    choice = choose_layout({1: CURVES[1]}, WorkloadHint(1536, 128), SLOTarget(4.0, 0.022),
                           cores=1)
    assert (choice.layout, choice.num_decode, choice.threads_per_worker) == (Layout.AGG, 1, 1)
    assert [c.label for c in choice.candidates] == ["agg x1"]


def test_within_ten_percent_colocated_then_mixed_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    def rates(disagg: float, agg2: float, mixed: float = 0.0) -> Any:
        table = {(Shape.DISAGG, 1): disagg, (Shape.MIXED, 1): mixed, (Shape.AGG, 2): agg2,
                 (Shape.AGG, 1): 0.1}
        return lambda shape, curves, num_p, num_d, *_: table[(shape, num_d)]

    def choose() -> Any:
        return choose_layout(CURVES, WorkloadHint(512, 128), SLOTarget(2.0, 0.05), cores=2)

    monkeypatch.setattr(layout_mod, "max_rate", rates(disagg=1.0, agg2=0.95))
    close = choose()
    assert close.label == "agg x2" and "within 10% of disagg 1P+1D" in close.reason
    monkeypatch.setattr(layout_mod, "max_rate", rates(disagg=1.0, agg2=0.85))
    far = choose()
    assert (far.label, far.disagg_policy) == ("disagg 1P+1D", "always")
    assert "within" not in far.reason
    # mixed within 10% of disagg: mixed, unless a colocated layout is within 10% too.
    monkeypatch.setattr(layout_mod, "max_rate", rates(disagg=1.0, agg2=0.85, mixed=0.92))
    mixed = choose()
    assert (mixed.label, mixed.disagg_policy) == ("mixed 1P+1D", "auto")
    assert "within 10% of disagg 1P+1D: mixed" in mixed.reason
    monkeypatch.setattr(layout_mod, "max_rate", rates(disagg=1.0, agg2=0.91, mixed=0.99))
    assert choose().label == "agg x2"
    monkeypatch.setattr(layout_mod, "max_rate", rates(disagg=1.0, agg2=0.85, mixed=0.89))
    assert choose().label == "disagg 1P+1D"


def test_without_slos_the_targets_come_from_the_measured_costs() -> None:
    choice = choose_layout(CURVES, WorkloadHint(512, 128), None, cores=2)
    assert choice.slo_derived and choice.slo is not None
    # A one-core worker's: 3x its 512-token prefill, 2x its batch-1 step.
    assert choice.slo.ttft_s == pytest.approx(3 * PREFILL_1(512))
    assert choice.slo.tpot_s == pytest.approx(2 * DECODE_1(1))
    assert "no SLO given" in choice.reason and "step of a 1-thread worker" in choice.reason
    wide = choose_layout(CURVES, WorkloadHint(512, 128), None, cores=2, threads_per_worker=2)
    assert wide.slo is not None and wide.slo.tpot_s == pytest.approx(2 * DECODE_2(1))


def test_targets_no_layout_meets_pick_the_closest() -> None:
    choice = choose_layout(CURVES, WorkloadHint(1536, 128), SLOTarget(0.5, 0.001), cores=2)
    assert all(c.max_rate == 0 for c in choice.candidates)
    assert "no layout meets these SLOs" in choice.reason
    # Unloaded, two threads prefill fastest and step fastest: the closest.
    assert choice.label == "agg x1" and choice.threads_per_worker == 2


def _source(calls: list[Sequence[int]], curves: Mapping[int, CostCurves] | None = None,
            error: Exception | None = None) -> Any:
    def measure(engine_args: Mapping[str, Any], threads: Sequence[int],
                cache: Path | None) -> Mapping[int, CostCurves]:
        calls.append(list(threads))
        if error is not None:
            raise error
        assert curves is not None
        return curves
    return measure


def test_auto_resolves_to_the_chosen_pools() -> None:
    calls: list[Sequence[int]] = []
    measured = {1: CostCurves(PREFILL_1, DECODE_1), 2: CostCurves(PREFILL_2, DECODE_2)}
    resolved = resolve_layout(ServeConfig(workload_hint="1536:128", slo_ttft_ms=4000,
                                          slo_tpot_ms=100), _source(calls, measured), cores=2)
    assert calls == [[1, 2]]
    assert (resolved.config.mode, resolved.config.prefill, resolved.config.decode) == (
        "agg", 0, 2)
    specs = worker_specs(resolved.config, "tcp://127.0.0.1:1")
    assert [s.role for s in specs] == [Role.BOTH, Role.BOTH]
    assert resolved.config.disagg_policy == "never"
    strict = resolve_layout(ServeConfig(workload_hint="1536:128", slo_ttft_ms=4000,
                                        slo_tpot_ms=22), _source(calls, measured), cores=2)
    assert (strict.config.mode, strict.config.prefill, strict.config.decode) == (
        "disagg", 1, 1)
    assert strict.choice.label == "mixed 1P+1D" and strict.config.disagg_policy == "auto"
    # The router's priors are the chosen width's measured curves (a decode worker seldom
    # prefills alone: its local prefills are judged by them), not the constant defaults.
    assert strict.curves is not None
    costs = router_costs(strict.curves)
    assert PrefillCostModel(costs).predict(1536) == pytest.approx(PREFILL_1(1536))
    assert DecodeStepModel(costs).predict(8) == pytest.approx(strict.curves.step_s(8))
    assert router_costs(None) == CostModelConfig()
    # --disagg-policy always with auto: mixed is not compared; disagg runs every prompt
    # remote, and the reason says why mixed is missing.
    always = resolve_layout(ServeConfig(workload_hint="1536:128", slo_ttft_ms=4000,
                                        slo_tpot_ms=22, disagg_policy="always"),
                            _source(calls, measured), cores=2)
    assert always.choice.label == "disagg 1P+1D" and always.config.disagg_policy == "always"
    assert all(c.shape is not Shape.MIXED for c in always.choice.candidates)
    assert "--disagg-policy always given: only agg and disagg compared" in always.choice.reason
    never = resolve_layout(ServeConfig(workload_hint="1536:128", slo_ttft_ms=4000,
                                       slo_tpot_ms=22, disagg_policy="never"),
                           _source(calls, measured), cores=2)
    assert never.config.mode == "agg" and {c.shape for c in never.choice.candidates} == {
        Shape.AGG}
    # One SLO given: the other is derived, and the reason says so.
    half = resolve_layout(ServeConfig(slo_ttft_ms=4000), _source(calls, measured), cores=2)
    assert half.choice.slo is not None and half.choice.slo.ttft_s == 4.0
    assert "--slo-tpot-ms not given" in half.choice.reason


@pytest.mark.parametrize("config, expected, reason", [
    (ServeConfig(mode="agg", decode=2), ("agg", 0, 2), "--mode agg given"),
    (ServeConfig(mode="disagg"), ("disagg", 1, 1), "--mode disagg given"),
    (ServeConfig(mode="disagg", disagg_policy="always"), ("disagg", 1, 1),
     "--mode disagg given"),
    (ServeConfig(prefill=1, decode=2), ("disagg", 1, 2), "pool counts given"),
    (ServeConfig(decode=3), ("disagg", 1, 3), "pool counts given"),
    (ServeConfig(planner="on", slo_ttft_ms=1000, slo_tpot_ms=50), ("disagg", 1, 1),
     "--planner on sizes a disaggregated layout"),
    (ServeConfig(runtime="ray"), ("disagg", 1, 1), "--runtime ray"),
])
def test_what_the_operator_fixed_is_honoured_without_measuring(
        config: ServeConfig, expected: tuple[str, int, int], reason: str) -> None:
    calls: list[Sequence[int]] = []
    resolved = resolve_layout(config, _source(calls), cores=2, cached=lambda *_: None)
    choice = resolved.choice
    assert calls == [] and resolved.curves is None  # none cached (test_layout_priors.py)
    assert (choice.layout.value, choice.num_prefill, choice.num_decode) == expected
    assert resolved.config.mode == expected[0] and reason in choice.reason
    # The user's --disagg-policy stands; disagg under auto runs (and is labeled) mixed.
    assert resolved.config.disagg_policy == config.disagg_policy
    policy = "never" if config.mode == "agg" else config.disagg_policy
    assert choice.disagg_policy == policy
    assert choice.shape.value == {"never": "agg", "always": "disagg", "auto": "mixed"}[policy]
    assert router_tpot_slo_s(resolved.config, choice) == (
        config.slo_tpot_ms / 1000 if config.slo_tpot_ms else None)
    assert len(worker_specs(resolved.config, "tcp://127.0.0.1:1")) == expected[1] + expected[2]


def test_a_failed_measurement_serves_the_former_default() -> None:
    calls: list[Sequence[int]] = []
    resolved = resolve_layout(ServeConfig(), _source(calls, error=LayoutProfileError(
        "took over 240 s")), cores=2, cached=lambda *_: None)
    assert calls == [[1, 2]] and resolved.config.mode == "disagg"
    assert "measuring the cost curves failed (took over 240 s)" in resolved.choice.reason


def test_the_choice_is_exposed_as_an_info_metric() -> None:
    choice = choose_layout(CURVES, WorkloadHint(1536, 128), SLOTarget(4.0, 0.022), cores=2)
    registry = CollectorRegistry()
    publish_layout(registry, choice)
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("splitserve_layout_info{"))
    assert 'layout="mixed"' in line and 'prefill="1"' in line and 'decode="1"' in line
    assert 'reason="mixed 1P+1D: 0.35 req/s vs ' in line and line.endswith(" 1.0")
    candidates = choice.to_dict()["candidates"]
    assert isinstance(candidates, list) and candidates[0]["layout"] == "agg x1 (2 threads)"


def test_serve_config_checks_the_hint_and_defaults_to_auto() -> None:
    assert ServeConfig().mode == "auto" and ServeConfig().workload_tokens == (512, 128, None)
    assert ServeConfig(workload_hint="1024:64").workload_tokens == (1024, 64, None)
    assert ServeConfig(workload_hint="839:24:0.9").workload_tokens == (839, 24, 0.9)
    for bad in ("512", "512:0", "a:b", "-5:3", "512:64:-1", "512:64:x", "512:64:nan",
                "512:64:0.5:1"):
        with pytest.raises(ValueError, match="workload_hint"):
            ServeConfig(workload_hint=bad)
    with pytest.raises(ValueError, match="--planner needs"):
        ServeConfig(mode="agg", planner="on", slo_ttft_ms=1000, slo_tpot_ms=50)


class _Reserved(Exception):
    """Raised where the cluster would start worker processes: what was built is checked."""


class _NoWorkers(LocalRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.specs: list[WorkerSpec] = []

    def reserve(self, specs: list[WorkerSpec], timeout_s: float) -> None:
        self.specs = specs
        raise _Reserved


@pytest.mark.parametrize("rates, label, policy, roles", [
    ({Shape.MIXED: 2.0, Shape.DISAGG: 1.0, Shape.AGG: 1.0}, "mixed 1P+1D", DisaggPolicy.AUTO,
     [Role.PREFILL, Role.DECODE]),
    ({Shape.MIXED: 1.0, Shape.DISAGG: 2.0, Shape.AGG: 1.0}, "disagg 1P+1D",
     DisaggPolicy.ALWAYS, [Role.PREFILL, Role.DECODE]),
    ({Shape.MIXED: 1.0, Shape.DISAGG: 1.0, Shape.AGG: 2.0}, "agg x2", DisaggPolicy.NEVER,
     [Role.BOTH, Role.BOTH]),
])
def test_the_chosen_policy_reaches_the_router(
        monkeypatch: pytest.MonkeyPatch, rates: dict[Shape, float], label: str,
        policy: DisaggPolicy, roles: list[Role]) -> None:
    """Cluster.start as `splitserve serve` runs it (no flags but the hint), up to where the
    workers would start: the dispatcher's router has the chosen kind's policy and, for
    mixed, the TPOT target its local prefills were modeled within (derived here: no SLO
    flags); the worker specs and /metrics match the choice."""
    measured = {1: CostCurves(PREFILL_1, DECODE_1), 2: CostCurves(PREFILL_2, DECODE_2)}
    monkeypatch.setattr(launcher_mod, "resolve_layout", functools.partial(
        resolve_layout, curves=_source([], measured), cores=2))
    # The winner by a margin: each kind's rate (agg x1 far behind), not the model's.
    monkeypatch.setattr(layout_mod, "max_rate", lambda shape, curves, num_p, num_d, *_:
                        rates[shape] * (0.1 if shape is Shape.AGG and num_d == 1 else 1))
    runtime = _NoWorkers()
    cluster = Cluster(ServeConfig(workload_hint="512:128"), runtime=runtime)
    with pytest.raises(_Reserved):
        asyncio.run(cluster.start())
    assert cluster.layout is not None and cluster.dispatcher is not None
    assert cluster.layout.label == label and cluster.config.disagg_policy == policy.name.lower()
    router = cluster.dispatcher.router.config
    assert router.disagg is policy
    assert cluster.layout.slo is not None and cluster.dispatcher.slo_tpot_s is None
    expected_tpot = cluster.layout.slo.tpot_s if policy is DisaggPolicy.AUTO else None
    assert router.tpot_slo_s == expected_tpot
    assert [s.role for s in runtime.specs] == roles
    text = generate_latest(cluster.dispatcher.metrics.registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("splitserve_layout_info{"))
    assert f'layout="{label.split()[0]}"' in line
