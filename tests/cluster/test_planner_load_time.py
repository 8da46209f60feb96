"""The model-load time the planner uses: measured start-to-registered durations (median),
an operator's override, the default before any start was measured; and the planner
looking that far ahead."""
from __future__ import annotations

import pytest

from splitserve.cluster.planner import Observation, Planner, PlannerConfig, WorkerSample
from splitserve.cluster.planner.load_time import (DEFAULT_MODEL_LOAD_S, NUM_KEPT,
                                                  LoadTimes, LoadTimeSource,
                                                  model_load_estimate)
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import Quadratic


def test_estimate_prefers_the_override_then_the_median_then_the_default() -> None:
    assert model_load_estimate([], None).seconds == DEFAULT_MODEL_LOAD_S
    assert model_load_estimate([], None).source is LoadTimeSource.DEFAULT
    assert model_load_estimate([], None, default=7.0).seconds == 7.0
    measured = model_load_estimate([4.0, 30.0, 5.0], None)  # one slow start: the median
    assert (measured.seconds, measured.source, measured.num_samples) == (
        5.0, LoadTimeSource.MEASURED, 3)
    assert model_load_estimate([4.0, 6.0], None).seconds == 5.0
    fixed = model_load_estimate([4.0, 6.0], 12.5)
    assert (fixed.seconds, fixed.source, fixed.num_samples) == (12.5, LoadTimeSource.FLAG, 2)
    assert fixed.to_dict() == {"seconds": 12.5, "source": "flag", "samples": 2}


def test_load_times_counts_each_started_incarnation_once() -> None:
    times = LoadTimes()
    times.started(b"decode-0:1", 100.0)
    times.started(b"decode-1:1", 101.0)
    assert times.registered(b"prefill-0:1", 105.0) is None  # adopted: not started here
    assert times.registered(b"decode-0:1", 108.5) == 8.5
    assert times.registered(b"decode-0:1", 120.0) is None  # seen again: counted already
    times.forget(b"decode-1:1")  # drained before it registered
    assert times.registered(b"decode-1:1", 130.0) is None
    times.started(b"decode-0:2", 200.0)  # a restart is a new start
    assert times.registered(b"decode-0:2", 210.5) == 10.5
    assert list(times.samples) == [8.5, 10.5]
    assert times.estimate(None).seconds == 9.5
    assert times.estimate(3.0).seconds == 3.0


def test_load_times_keep_the_most_recent_starts() -> None:
    times = LoadTimes()
    for i in range(NUM_KEPT + 4):
        identity = f"decode-{i}:1".encode()
        times.started(identity, 0.0)
        times.registered(identity, 100.0 if i < 4 else 2.0)  # the first 4 were slow
    assert len(times.samples) == NUM_KEPT
    assert times.estimate(None).seconds == 2.0


def _observe(now: float, rate: float, load_s: float | None) -> Observation:
    decode = Quadratic(0.03, 0.0005, 0.0)
    prefill = Quadratic(0.01, 0.0005, 1e-8)
    workers = (WorkerSample("prefill-0", Role.PREFILL, False, prefill, decode),
               WorkerSample("decode-0", Role.DECODE, False, prefill, decode))
    return Observation(now, 10.0, round(rate * 10), 512, 128, None, None, workers, load_s)


@pytest.mark.parametrize("configured", [0.0, 60.0])
def test_planner_looks_ahead_by_the_observed_model_load(configured: float) -> None:
    """The same rising load: sized for further ahead with a longer measured load time,
    whatever the config's default says."""
    cfg = PlannerConfig(slo_ttft_s=1.0, slo_tpot_s=0.05, max_workers=16,
                        allow_colocated=False, model_load_s=configured)

    def sized_rate(load_s: float | None) -> float:
        planner = Planner(cfg)
        decision = None
        for k in range(6):
            decision = planner.step(_observe(10.0 * (k + 1), 1.0 + k, load_s))
        assert decision is not None
        return decision.predicted_rate

    assert sized_rate(90.0) > sized_rate(0.0)
    assert sized_rate(None) == sized_rate(configured)
