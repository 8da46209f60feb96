"""The planner's logic on synthetic metric series: a small simulator plays the cluster
(workers start warming, switch roles, leave) and feeds the planner every interval."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from splitserve.cluster.planner import (Decision, Layout, Observation, Planner,
                                        PlannerConfig, StepKind, WorkerSample, check_budget,
                                        plan_steps)
from splitserve.cluster.planner.capacity import Curves, Demand, size_disagg
from splitserve.cluster.planner.queueing import Service, erlang_c, wait_quantile
from splitserve.cluster.frontend.interval import IntervalStats
from splitserve.cluster.planner.forecast import LoadForecast
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import Quadratic

PREFILL = Quadratic(0.01, 0.0005, 1e-8)  # ~0.27 s for 512 tokens
DECODE = Quadratic(0.03, 0.0005, 0.0)  # 40 sequences fit a 50 ms TPOT
SLOW = Quadratic(5.0, 0.05, 1e-5)  # what a cold worker's first samples look like
CFG = PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, max_workers=16, allow_colocated=False)


class Sim:
    """Workers by id -> (role, time started); a started worker warms for model_load_s."""

    def __init__(self, config: PlannerConfig, num_prefill: int, num_decode: int,
                 role: Role = Role.DECODE, warm_curve: Quadratic | None = SLOW) -> None:
        self.config = config
        self.now = 0.0
        self.warm_curve = warm_curve
        self.workers: dict[str, tuple[Role, float]] = {}
        self.num_started = 0
        for r, n in ((Role.PREFILL, num_prefill), (role, num_decode)):
            for _ in range(n):
                self._start(r, -1e9)

    def _start(self, role: Role, at: float) -> None:
        self.workers[f"w{self.num_started}"] = (role, at)
        self.num_started += 1

    def counts(self) -> tuple[int, int]:
        roles = [r for r, _ in self.workers.values()]
        return roles.count(Role.PREFILL), len(roles) - roles.count(Role.PREFILL)

    def observe(self, rate: float, prompt: float, output: float, rng: random.Random | None
                = None, running: int = 0, ttft: float | None = None,
                prompt_cv: float | None = None) -> Observation:
        self.now += self.config.interval_s
        lam = rate * self.config.interval_s
        arrivals = round(lam if rng is None else max(0.0, rng.gauss(lam, math.sqrt(lam))))
        if rng is not None:  # +-10% noise on the measured lengths
            prompt *= rng.uniform(0.9, 1.1)
            output *= rng.uniform(0.9, 1.1)
        samples = []
        for worker_id, (role, started) in sorted(self.workers.items()):
            warming = self.now - started < self.config.model_load_s
            curves = (self.warm_curve, self.warm_curve) if warming else (PREFILL, DECODE)
            samples.append(WorkerSample(worker_id, role, warming, *curves,
                                        num_running=running if role is not Role.PREFILL else 0))
        return Observation(self.now, self.config.interval_s, arrivals, prompt, output,
                           ttft, None, tuple(samples), prompt_cv=prompt_cv)

    def apply(self, decision: Decision) -> None:
        assert check_budget(len(self.workers), decision.steps, self.config.budget)
        for step in decision.steps:
            if step.kind is StepKind.ADD:
                assert step.role is not None
                self._start(step.role, self.now)
            elif step.kind is StepKind.REMOVE:
                assert step.worker_id is not None
                del self.workers[step.worker_id]
            else:  # a switch keeps the weights: not warming again
                assert step.worker_id is not None and step.role is not None
                self.workers[step.worker_id] = (step.role, self.workers[step.worker_id][1])
        assert self.counts() == (decision.num_prefill, decision.num_decode)

    def run(self, planner: Planner, num: int, rate: float, prompt: float = 512,
            output: float = 128, rng: random.Random | None = None, running: int = 0,
            ttft: float | None = None, prompt_cv: float | None = None) -> list[Decision]:
        decisions = []
        for _ in range(num):
            decision = planner.step(self.observe(rate, prompt, output, rng, running, ttft,
                                                 prompt_cv))
            self.apply(decision)
            decisions.append(decision)
        return decisions


def test_erlang_c_matches_closed_forms() -> None:
    for rho in (0.1, 0.5, 0.9):
        assert erlang_c(1, rho) == pytest.approx(rho)  # M/M/1: P(wait) = rho
        assert erlang_c(2, 2 * rho) == pytest.approx(2 * rho ** 2 / (1 + rho))
    # M/M/1 p90 wait: rho exp(-(mu - lambda) t) = 0.1.
    mm1 = replace(CFG, arrival_cv2=1.0, service_cv2=1.0)
    exponential, fixed = Service(0.25, 1.0, 0.25), Service(0.25, 0.0, 0.25)
    assert wait_quantile(3.0, exponential, 1, mm1) == pytest.approx(
        math.log(0.75 / 0.1) / (4 - 3))
    assert wait_quantile(3.0, fixed, 1, mm1) == pytest.approx(
        math.log(0.75 / 0.1) / 2)  # M/D/1 by Allen-Cunneen: half
    assert wait_quantile(4.0, exponential, 1, mm1) == math.inf


def test_sizes_follow_the_queueing_and_littles_law() -> None:
    curves = Curves(PREFILL, DECODE, max_num_seqs=256)
    demand = Demand(rate=20.0, prompt_tokens=512, output_tokens=128, backlog=0, running=0,
                    interval_s=10.0)
    sizing = size_disagg(demand, curves, CFG)
    # Decode: 40 sequences per worker at 50 ms; 20/s * 128 tokens * 0.05 s = 128 running.
    assert curves.max_batch(0.05) == 40
    assert sizing.num_decode == math.ceil(20 * 128 * 0.05 / 40)
    # Prefill: the smallest c whose p90 TTFT meets 1 s, more than the offered load alone.
    service = PREFILL(512)
    ok = [c for c in range(1, 17)
          if wait_quantile(20.0, Service(service, CFG.service_cv2, service), c, CFG) + service
          <= 1.0]
    assert sizing.num_prefill == ok[0] > math.ceil(20 * service)
    assert sizing.is_feasible and sizing.fit.ttft_s <= 1.0 and sizing.fit.tpot_s <= 0.05
    # Sequences running now count even above Little's law; a backlog drains in an interval.
    assert size_disagg(demand._replace(running=280), curves, CFG).num_decode == 7
    assert size_disagg(demand._replace(backlog=100), curves, CFG).num_prefill > ok[0]
    # The planner's first decision: that sizing at the forecast plus its headroom (the
    # noise prior, before any noise is measured).
    decision = Sim(CFG, 1, 1).run(Planner(CFG), 1, rate=20.0)[-1]
    head = max(CFG.band, CFG.noise_z * CFG.noise_prior)
    grown = size_disagg(demand._replace(rate=20.0 * (1 + head)), curves, CFG)
    assert (decision.num_prefill, decision.num_decode) == (grown.num_prefill, grown.num_decode)
    assert decision.predicted_ttft_s <= 1.0 and decision.predicted_tpot_s <= 0.05
    assert any("forecast" in r for r in decision.reasons)


def test_step_up_then_down_in_load() -> None:
    sim, planner = Sim(CFG, 1, 1), Planner(CFG)
    sim.run(planner, 10, rate=2.0)
    low = sim.counts()
    up = sim.run(planner, 3, rate=20.0)
    high = sim.counts()
    assert high[0] > low[0] and high[1] > low[1]
    assert up[-1].predicted_ttft_s <= CFG.slo_ttft_s and up[-1].predicted_tpot_s <= 0.05
    sim.run(planner, 20, rate=2.0)  # the shrink waits out scale_down_window_s (12)
    final = sim.counts()
    assert final[0] < high[0] and final[1] < high[1]
    assert low[0] <= final[0] <= low[0] + 1 and low[1] <= final[1] <= low[1] + 1


def test_prompt_heavy_shift_grows_prefill_only() -> None:
    sim, planner = Sim(CFG, 1, 1), Planner(CFG)
    sim.run(planner, 8, rate=8.0, prompt=256)
    before = sim.counts()
    sim.run(planner, 8, rate=8.0, prompt=1024)
    after = sim.counts()
    assert after[0] > before[0] and after[1] == before[1]


def test_spread_prompts_need_more_prefill_than_their_mean() -> None:
    """The same mean prompt, measured spread: the long prompts' prefill and the longer
    queues of a spread service need more prefill workers for the same p90 TTFT; decode
    is unchanged (it sees the mean output only)."""
    counts = {}
    for cv in (None, 1.5):
        sim = Sim(CFG, 1, 1)
        decisions = sim.run(Planner(CFG), 8, rate=8.0, prompt=512, prompt_cv=cv)
        counts[cv] = sim.counts()
        assert decisions[-1].predicted_ttft_s <= CFG.slo_ttft_s
    assert counts[1.5][0] > counts[None][0] and counts[1.5][1] == counts[None][1]


def test_forecast_smooths_the_measured_spread_and_keeps_it_through_gaps() -> None:
    fc = LoadForecast(alpha=0.5, beta=0.2, damping=0.8)
    fc.observe(1.0, 10, 500.0, 100.0, is_idle=False)
    assert fc.prompt_cv is None  # nothing measured: the mean stands for all
    fc.observe(1.0, 10, 500.0, 100.0, is_idle=False, prompt_cv=1.0)
    fc.observe(1.0, 1, 500.0, 100.0, is_idle=False, prompt_cv=None)  # one arrival
    assert fc.prompt_cv == 1.0
    fc.observe(1.0, 10, 500.0, 100.0, is_idle=False, prompt_cv=0.2)
    assert fc.prompt_cv == pytest.approx(0.6)


def test_interval_measures_the_uncached_prompts_spread() -> None:
    stats = IntervalStats(0.0, None, None)
    stats.routed(100)
    assert stats.take(1.0).prompt_cv is None  # one arrival: no spread
    for tokens in (100, 300):
        stats.routed(tokens)
    totals = stats.take(2.0)
    assert totals.mean_prompt_tokens == 200 and totals.prompt_cv == pytest.approx(0.5)
    for _ in range(3):
        stats.routed(64)
    assert stats.take(3.0).prompt_cv == 0.0


def test_output_heavy_shift_grows_decode_only() -> None:
    sim, planner = Sim(CFG, 1, 1), Planner(CFG)
    sim.run(planner, 8, rate=8.0, output=64)
    before = sim.counts()
    sim.run(planner, 8, rate=8.0, output=512)
    after = sim.counts()
    assert after[1] > before[1] and after[0] == before[0]


def test_constant_load_changes_nothing_after_the_first_interval() -> None:
    sim, planner = Sim(CFG, 1, 1), Planner(CFG)
    decisions = sim.run(planner, 50, rate=12.0)
    assert [i for i, d in enumerate(decisions) if d.steps] == [0]
    assert sim.counts()[0] > 1 and sim.counts()[1] > 1


@pytest.mark.parametrize("rate", [3.0, 7.0, 12.0, 20.0, 40.0])  # 40/s is over the budget
def test_constant_noisy_load_does_not_oscillate(rate: float) -> None:
    """Poisson arrivals and +-10% lengths: after 10 intervals to learn the noise, no pool
    changes direction and each changes at most once (a late correction), in 50."""
    num_late = 0
    for seed in range(8):
        sim, planner = Sim(CFG, 1, 1), Planner(CFG)
        decisions = sim.run(planner, 50, rate=rate, rng=random.Random(seed))
        for pool in (0, 1):
            sizes = [(d.num_prefill, d.num_decode)[pool] for d in decisions[9:]]
            moves = [b - a for a, b in zip(sizes, sizes[1:]) if b != a]
            assert len(moves) <= 1, (seed, pool, sizes)
            num_late += len(moves)
    assert num_late <= 4  # of 16 pool-runs


def test_zero_load_reaches_minimums_within_three_intervals() -> None:
    cfg = replace(CFG, scale_down_cooldown_s=300.0, min_prefill=1, min_decode=2)
    sim, planner = Sim(cfg, 1, 2), Planner(cfg)
    sim.run(planner, 6, rate=20.0)
    assert sim.counts()[0] > 3
    # Sequences still finishing in the first quiet interval; none after.
    sim.run(planner, 1, rate=0.0, running=30)
    sim.run(planner, 2, rate=0.0)
    assert sim.counts() == (1, 2)  # despite a 300 s scale-down cooldown


def test_tight_budget_never_exceeded_at_any_step() -> None:
    cfg = replace(CFG, max_workers=6, allow_role_switch=False)
    sim, planner = Sim(cfg, 1, 5), Planner(cfg)
    # Long prompts, short outputs: prefill wants most of the budget; then the reverse.
    kinds = set()
    for prompt, output in ((2048, 16), (64, 2048), (2048, 16)):
        for decision in sim.run(planner, 8, rate=4.0, prompt=prompt, output=output):
            assert decision.num_prefill + decision.num_decode <= 6  # and every prefix, in apply
            kinds |= {(s.kind, s.from_role or s.role) for s in decision.steps}
    # Both pools grew and shrank: the order of the steps mattered.
    assert {(StepKind.ADD, Role.PREFILL), (StepKind.REMOVE, Role.PREFILL),
            (StepKind.ADD, Role.DECODE), (StepKind.REMOVE, Role.DECODE)} <= kinds
    # With free room the adds go first; at the budget the removals do.
    workers = tuple(WorkerSample(f"p{i}", Role.PREFILL, False, None, None) for i in range(3)) \
        + tuple(WorkerSample(f"d{i}", Role.DECODE, False, None, None) for i in range(3))
    target = {Role.PREFILL: 5, Role.DECODE: 1}
    tight = plan_steps(workers, target, 6, allow_switch=False)
    assert [s.kind for s in tight] == [StepKind.REMOVE] * 2 + [StepKind.ADD] * 2
    assert check_budget(6, tight, 6) and not check_budget(6, tight[::-1], 6)
    roomy = plan_steps(workers, target, 10, allow_switch=False)
    assert [s.kind for s in roomy] == [StepKind.ADD] * 2 + [StepKind.REMOVE] * 2
    switched = plan_steps(workers, target, 6, allow_switch=True)
    assert [(s.kind, s.from_role, s.role) for s in switched] == \
        [(StepKind.SWITCH, Role.DECODE, Role.PREFILL)] * 2


def test_warming_workers_count_in_size_but_not_in_capacity() -> None:
    def first(warm_curve: Quadratic | None, warming: bool = True) -> Decision:
        sim = Sim(CFG, 2, 2, warm_curve=warm_curve)
        if warming:
            sim._start(Role.DECODE, 0.0)  # warming through the first 3 intervals
        return sim.run(Planner(CFG), 1, rate=20.0)[-1]

    with_slow, with_none, absent = first(SLOW), first(None), first(None, warming=False)
    targets = {(d.num_prefill, d.num_decode) for d in (with_slow, with_none, absent)}
    assert len(targets) == 1 and with_slow.num_decode >= 3
    assert with_slow.predicted_ttft_s == with_none.predicted_ttft_s
    # Had the slow curve entered capacity, the SLOs would look unmeetable.
    assert with_slow.predicted_ttft_s <= 1.0 and with_slow.predicted_tpot_s <= 0.05
    # The warming worker is one of the decode pool: one decode worker fewer to start.
    def decode_adds(d: Decision) -> int:
        return sum(s.kind is StepKind.ADD and s.role is Role.DECODE for s in d.steps)
    assert decode_adds(with_slow) == decode_adds(absent) - 1
    # Only warming workers: the planner keeps the curves it had (here the priors).
    cold = Sim(CFG, 1, 1)
    cold.workers = {k: (r, 0.0) for k, (r, _) in cold.workers.items()}
    assert Planner(CFG).step(cold.observe(2.0, 512, 128)).predicted_ttft_s < 1.0


def test_layout_follows_prompt_length() -> None:
    cfg = replace(CFG, allow_colocated=True, scale_down_cooldown_s=20.0)
    sim, planner = Sim(cfg, 1, 1), Planner(cfg)
    # 3 req/s: at 4, one colocated worker's p90 TPOT (its requests' collisions with the
    # prompts it prefills, capacity.fit_agg) sits at the SLO's edge, agg and disagg need
    # two workers each, and the planner keeps the layout it runs.
    short = sim.run(planner, 8, rate=3.0, prompt=32, output=100)
    assert short[-1].layout is Layout.AGG and sim.counts()[0] == 0
    assert any(s.kind is StepKind.SWITCH and s.role is Role.BOTH for d in short for s in d.steps)
    long = sim.run(planner, 8, rate=3.0, prompt=1024, output=100)
    assert long[-1].layout is Layout.DISAGG and sim.counts()[0] >= 1
    assert long[-1].predicted_ttft_s <= 1.0 and long[-1].predicted_tpot_s <= 0.05
    # Colocated, 1024-token prompts would need more workers (their prefill stalls decode).
    assert any("disagg" in r and "agg ->" in r for r in long[-1].reasons + long[0].reasons)
    again = sim.run(planner, 8, rate=3.0, prompt=32, output=100)
    assert again[-1].layout is Layout.AGG


def test_model_load_time_scales_up_earlier_on_a_rising_trend() -> None:
    def first_growth(model_load_s: float) -> int:
        cfg = replace(CFG, model_load_s=model_load_s)
        sim, planner = Sim(cfg, 1, 1), Planner(cfg)
        sim.run(planner, 5, rate=2.0)
        start = sim.counts()[1]
        for k in range(30):
            sim.run(planner, 1, rate=2.0 + 0.5 * k)
            if sim.counts()[1] > start:
                return k
        raise AssertionError("never grew")

    assert first_growth(60.0) < first_growth(0.0)


def test_measured_misses_correct_an_optimistic_model() -> None:
    def prefill_after(attained: float) -> int:
        sim, planner = Sim(CFG, 1, 1), Planner(CFG)
        sim.run(planner, 6, rate=4.0, ttft=attained)
        return sim.counts()[0]

    assert prefill_after(0.5) > prefill_after(1.0)
