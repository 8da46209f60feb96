"""Arrival schedules: seeded, right mean rate and burstiness, all at once, trace replay."""
from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.bench.arrivals import gamma_arrivals, mean_rate, schedule, trace_arrivals
from splitserve.bench.config import BenchConfig, LengthDist
from splitserve.bench.request import BenchRequest
from splitserve.bench.workload import Workload, WorkloadInfo, build_workload


def _cv(times: list[float]) -> float:
    gaps = np.diff(times)
    return float(gaps.std() / gaps.mean())


def test_gamma_arrivals_are_seeded() -> None:
    a = gamma_arrivals(50, 2.0, 1.0, np.random.default_rng(7))
    assert a == gamma_arrivals(50, 2.0, 1.0, np.random.default_rng(7))
    assert a != gamma_arrivals(50, 2.0, 1.0, np.random.default_rng(8))
    assert a[0] == 0.0 and a == sorted(a) and len(a) == 50


@pytest.mark.parametrize("burstiness,cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_mean_rate_and_burstiness(burstiness: float, cv: float) -> None:
    times = gamma_arrivals(20000, 5.0, burstiness, np.random.default_rng(0))
    assert mean_rate(times) == pytest.approx(5.0, rel=0.04)
    assert _cv(times) == pytest.approx(cv, rel=0.06)  # CV of gamma(k) intervals = 1/sqrt(k)


def test_rate_inf_is_all_at_once() -> None:
    assert gamma_arrivals(5, math.inf, 1.0, np.random.default_rng(0)) == [0.0] * 5
    assert mean_rate([0.0] * 5) is None


def test_schedule_kinds_for_generated_workloads() -> None:
    cfg = BenchConfig(num_requests=8, input_len=LengthDist("fixed", 4),
                      output_len=LengthDist("fixed", 2))
    wl = build_workload(cfg, None)
    times, info = schedule(cfg, wl)
    assert times == [0.0] * 8 and info.kind == "all at once"
    times, info = schedule(BenchConfig(num_requests=8, rate=2.0), wl)
    assert info.kind == "poisson" and times[0] == 0.0 and len(set(times)) == 8
    _, info = schedule(BenchConfig(num_requests=8, rate=2.0, burstiness=0.5), wl)
    assert info.kind == "gamma" and info.burstiness == 0.5


def test_a_sweep_scales_the_same_draws() -> None:
    wl = build_workload(BenchConfig(num_requests=20, input_len=LengthDist("fixed", 4)), None)
    slow, _ = schedule(BenchConfig(num_requests=20, rate=2.0, run_index=0), wl)
    fast, _ = schedule(BenchConfig(num_requests=20, rate=4.0, run_index=1), wl)
    assert slow == pytest.approx([2 * t for t in fast])


def _trace_workload(stamps: list[float], jitter_s: float = 0.0) -> Workload:
    reqs = [BenchRequest([1, 2], 1, timestamp_s=t) for t in stamps]
    info = WorkloadInfo("azure", "", len(reqs), 1.0, None, 0, 2, 2, 1, 1, 0.0)
    return Workload(reqs, info, jitter_s=jitter_s)


def test_trace_timestamps_are_replayed_and_time_scaled() -> None:
    wl = _trace_workload([100.0, 103.0, 103.0, 109.0])
    times, info = schedule(BenchConfig(workload="azure", time_scale=0.5), wl)
    assert times == pytest.approx([0.0, 1.5, 1.5, 4.5])
    assert info.kind == "trace" and info.time_scale == 0.5
    assert info.mean_rate == pytest.approx(3 / 4.5)


def test_trace_rescaled_to_a_rate() -> None:
    wl = _trace_workload([0.0, 3.0, 3.0, 9.0])
    times, info = schedule(BenchConfig(workload="azure", rate=2.0), wl)
    assert mean_rate(times) == pytest.approx(2.0)
    assert info.time_scale == pytest.approx((3 / 9) / 2.0)
    times, info = schedule(BenchConfig(workload="azure", rate=math.inf), wl)
    assert times == [0.0] * 4 and info.kind == "all at once"


def test_trace_jitter_spreads_equal_timestamps() -> None:
    times = trace_arrivals([0.0] * 100 + [3.0] * 100, 3.0, 1.0, np.random.default_rng(0))
    assert min(times) == 0.0 and max(times) < 6.0
    assert len(set(times)) == 200
    assert np.mean(times[:100]) == pytest.approx(1.5, abs=0.3)
