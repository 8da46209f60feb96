"""Capacity with queueing: predicted TTFT and TPOT of a layout at given worker counts, and
the smallest counts that meet the SLOs. The equations are in planner.py's docstring."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from splitserve.cluster.planner.model import Layout, PlannerConfig
from splitserve.cluster.router.cost_model import Quadratic

INF = float("inf")


class Demand(NamedTuple):
    """The load to size for."""

    rate: float  # requests per second arriving
    prompt_tokens: float  # mean uncached prompt
    output_tokens: float  # mean output
    backlog: int  # prompts queued for prefill now
    running: int  # sequences decoding now
    interval_s: float

    @property
    def prefill_rate(self) -> float:
        """Arrivals plus the backlog, which should drain within one interval."""
        return self.rate + self.backlog / self.interval_s

    def sequences(self, tpot_s: float) -> float:
        """Concurrent decoding sequences (Little's law: L = rate * output * TPOT), and no
        fewer than run now."""
        return max(self.rate * self.output_tokens * tpot_s, float(self.running))

    def scaled(self, factor: float) -> Demand:
        return self._replace(rate=self.rate * factor, backlog=math.ceil(self.backlog * factor),
                             running=math.ceil(self.running * factor))


class Curves(NamedTuple):
    """Per-worker cost curves of the pool, times the planner's correction factors (>= 1,
    raised when measured attainment falls short of what they predicted)."""

    prefill: Quadratic
    decode: Quadratic
    max_num_seqs: int
    prefill_factor: float = 1.0
    decode_factor: float = 1.0

    def prefill_s(self, tokens: float) -> float:
        return self.prefill(tokens) * self.prefill_factor if tokens > 0 else 0.0

    def step_s(self, num_seqs: int) -> float:
        return self.decode(max(num_seqs, 1)) * self.decode_factor

    def max_batch(self, tpot_s: float) -> int:
        """The largest batch whose step fits in tpot_s (0 when not even one does)."""
        lo, hi = 0, self.max_num_seqs  # step_s is non-decreasing: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.step_s(mid) <= tpot_s else (lo, mid - 1)
        return lo


class Fit(NamedTuple):
    ttft_s: float  # at the attainment_target quantile
    tpot_s: float


class Sizing(NamedTuple):
    """Counts for a layout (num_prefill = 0 when colocated) and the fit there."""

    layout: Layout
    num_prefill: int
    num_decode: int
    fit: Fit
    is_feasible: bool  # the SLOs are met within the bounds and the budget

    @property
    def total(self) -> int:
        return self.num_prefill + self.num_decode


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with `offered` = rate * service < servers."""
    blocking = 1.0  # Erlang B by its recurrence, stable for any c
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1 - blocking))


def wait_quantile(rate: float, service_s: float, servers: int, config: PlannerConfig) -> float:
    """Queueing delay not exceeded by a share attainment_target of arrivals; inf when the
    servers cannot keep up."""
    if rate <= 0 or service_s <= 0:
        return 0.0
    offered = rate * service_s
    if offered >= servers:
        return INF
    tail = 1 - config.attainment_target
    waits = erlang_c(servers, offered)
    if waits <= tail:
        return 0.0
    # M/M/c: P(W > t) = C * exp(-(c/S - rate) t); Allen-Cunneen scales it to G/G/c.
    mmc = math.log(waits / tail) / (servers / service_s - rate)
    return mmc * (config.arrival_cv2 + config.service_cv2) / 2


def fit_disagg(demand: Demand, curves: Curves, num_prefill: int, num_decode: int,
               config: PlannerConfig) -> Fit:
    service = curves.prefill_s(demand.prompt_tokens)
    ttft = wait_quantile(demand.prefill_rate, service, num_prefill, config) + service
    per_worker = math.ceil(demand.sequences(config.slo_tpot_s) / num_decode)
    tpot = curves.step_s(per_worker) if per_worker <= curves.max_num_seqs else INF
    return Fit(ttft, tpot)


def fit_agg(demand: Demand, curves: Curves, num_workers: int, config: PlannerConfig) -> Fit:
    """Colocated: each worker's decode steps share it with the prompts it prefills."""
    per_worker = math.ceil(demand.sequences(config.slo_tpot_s) / num_workers)
    if per_worker > curves.max_num_seqs:
        return Fit(INF, INF)
    service = curves.prefill_s(demand.prompt_tokens)
    step = curves.step_s(per_worker)
    prefill_share = demand.prefill_rate * service / num_workers
    tpot = step / (1 - prefill_share) if prefill_share < 1 else INF
    # A prompt rides one step with the running batch: its service includes that step.
    with_step = service + step if service > 0 else 0.0
    ttft = wait_quantile(demand.prefill_rate, with_step, num_workers, config) + with_step
    return Fit(ttft, tpot)


def fit_at(layout: Layout, demand: Demand, curves: Curves, num_prefill: int,
           num_decode: int, config: PlannerConfig) -> Fit:
    """Predicted TTFT and TPOT of a layout at the given counts (inf: cannot keep up)."""
    if num_decode < 1 or (layout is Layout.DISAGG and num_prefill < 1):
        return Fit(INF, INF)
    if layout is Layout.AGG:
        return fit_agg(demand, curves, num_decode, config)
    return fit_disagg(demand, curves, num_prefill, num_decode, config)


def _smallest(meets: Callable[[int], bool], lo: int, hi: int) -> tuple[int, bool]:
    """The smallest count in lo..hi that meets, else (hi, False)."""
    for count in range(lo, hi + 1):
        if meets(count):
            return count, True
    return max(lo, hi), False


def size_disagg(demand: Demand, curves: Curves, config: PlannerConfig) -> Sizing:
    """Each pool on its own: prefill against the TTFT SLO, decode against TPOT. Over the
    budget, the budget is split in proportion to what each pool needs."""
    budget = config.budget
    service = curves.prefill_s(demand.prompt_tokens)
    num_p, p_ok = _smallest(
        lambda c: wait_quantile(demand.prefill_rate, service, c, config) + service
        <= config.slo_ttft_s,
        config.min_prefill, min(config.max_prefill, budget - config.min_decode))
    max_batch = curves.max_batch(config.slo_tpot_s)
    needed = demand.sequences(config.slo_tpot_s)
    d_hi = min(config.max_decode, budget - config.min_prefill)
    num_d = max(config.min_decode, math.ceil(needed / max_batch)) if max_batch else d_hi
    d_ok = max_batch > 0 and num_d <= d_hi
    num_d = min(num_d, d_hi)
    if num_p + num_d > budget:
        p_ok = d_ok = False
        share = round(budget * num_p / (num_p + num_d))
        num_p = min(max(share, config.min_prefill), budget - config.min_decode)
        num_d = budget - num_p
    fit = fit_disagg(demand, curves, num_p, num_d, config)
    return Sizing(Layout.DISAGG, num_p, num_d, fit, p_ok and d_ok)


def size_agg(demand: Demand, curves: Curves, config: PlannerConfig) -> Sizing:
    """The fewest colocated workers meeting both SLOs (interference included)."""
    def meets(count: int) -> bool:
        ttft, tpot = fit_agg(demand, curves, count, config)
        return ttft <= config.slo_ttft_s and tpot <= config.slo_tpot_s

    count, ok = _smallest(meets, config.min_decode, config.budget)
    return Sizing(Layout.AGG, 0, count, fit_agg(demand, curves, count, config), ok)


def size(layout: Layout, demand: Demand, curves: Curves, config: PlannerConfig) -> Sizing:
    if layout is Layout.AGG:
        return size_agg(demand, curves, config)
    return size_disagg(demand, curves, config)
