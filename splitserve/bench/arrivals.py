"""Arrival schedules: when (seconds after the run's start) each request is due.

Generated arrivals follow vLLM's benchmark_serving: the first request at 0, then gamma
intervals with shape = burstiness and mean 1/rate (burstiness 1 = Poisson; < 1 burstier,
> 1 more regular); rate inf = all at once. Trace arrivals replay the timestamps, shifted
to start at 0, jittered (uniform, to undo a coarse clock) and time-scaled.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.bench.config import BenchConfig
from splitserve.bench.workload import Workload


@dataclass(frozen=True)
class ArrivalInfo:
    """How the schedule was made, as the report prints it."""
    kind: str  # "all at once" | "poisson" | "gamma" | "trace"
    rate: float | None  # the requested rate (None: the trace's own)
    burstiness: float | None
    time_scale: float | None  # trace: factor applied to the trace's inter-arrival times
    jitter_s: float | None
    mean_rate: float | None  # the schedule's (n - 1) / (last - first arrival); None if 0 span
    span_s: float  # last arrival


def gamma_arrivals(n: int, rate: float, burstiness: float,
                   rng: np.random.Generator) -> list[float]:
    """`n` arrival times: 0, then cumulative gamma(shape=burstiness, scale=1/(rate *
    burstiness)) intervals (mean 1/rate; coefficient of variation 1/sqrt(burstiness))."""
    if math.isinf(rate):
        return [0.0] * n
    intervals = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=max(0, n - 1))
    return [0.0, *np.cumsum(intervals).tolist()][:n]


def trace_arrivals(timestamps: Sequence[float], jitter_s: float, time_scale: float,
                   rng: np.random.Generator) -> list[float]:
    """(timestamp - first timestamp + U[0, jitter_s)) * time_scale for each request."""
    first = min(timestamps)
    jitter = rng.uniform(0.0, jitter_s, size=len(timestamps)) if jitter_s > 0 else np.zeros(
        len(timestamps))
    times = [(t - first + float(j)) * time_scale for t, j in zip(timestamps, jitter)]
    start = min(times)
    return [t - start for t in times]


def mean_rate(times: Sequence[float]) -> float | None:
    """(n - 1) / span of a schedule; None when every request is due at once."""
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else None


def schedule(config: BenchConfig, workload: Workload) -> tuple[list[float], ArrivalInfo]:
    """The arrival time of each of the workload's requests (in request order)."""
    n = len(workload.requests)
    rng = np.random.default_rng([config.seed, 1])  # the same draws for every rate of a sweep
    rate = config.rate
    if config.is_trace and (rate is None or math.isfinite(rate)):
        stamps = [float(r.timestamp_s or 0.0) for r in workload.requests]
        times = trace_arrivals(stamps, workload.jitter_s, 1.0, rng)
        time_scale = config.time_scale or 1.0
        natural = mean_rate(times)
        if rate is not None and natural is not None:
            time_scale = natural / rate  # rescaled to the requested mean rate
        times = [t * time_scale for t in times]
        info = ArrivalInfo("trace", rate, None, time_scale, workload.jitter_s,
                           mean_rate(times), max(times))
        return times, info
    if rate is None or math.isinf(rate):
        return [0.0] * n, ArrivalInfo("all at once", math.inf, None, None, None, None, 0.0)
    times = gamma_arrivals(n, rate, config.burstiness, rng)
    kind = "poisson" if config.burstiness == 1.0 else "gamma"
    return times, ArrivalInfo(kind, rate, config.burstiness, None, None, mean_rate(times),
                              max(times))
