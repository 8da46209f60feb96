"""Capacity with queueing: predicted TTFT and TPOT of a layout at given worker counts, and
the smallest counts that meet the SLOs. The equations: planner.py's docstring; fit_mixed's
(decode workers that also prefill) and prefill_service's (prompt lengths) in their own."""
from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import NamedTuple

from splitserve.cluster.planner.model import Layout, PlannerConfig
from splitserve.cluster.planner.queueing import (INF, Service, mean_wait, progeny_quantile,
                                                 wait_quantile)
from splitserve.cluster.router.config import KVLayout, RouterConfig
from splitserve.cluster.router.cost_model import Quadratic

_SHARE_STEPS = 32  # bisection steps of the local share: to ~2e-10


class Demand(NamedTuple):
    """The load to size for."""

    rate: float  # requests per second arriving
    prompt_tokens: float  # mean uncached prompt
    output_tokens: float  # mean output
    backlog: int  # prompts queued for prefill now
    running: int  # sequences decoding now
    interval_s: float
    # The prompt length's coefficient of variation (std / mean); None: unknown, and
    # PlannerConfig.service_cv2 stands for the spread of prefill times.
    prompt_cv: float | None = None

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
    # What a step adds per sequence per token of its context (profile.py), and the
    # workload's mean context over a decode (layout.py: prompt + half the output); the
    # planner's live curves are fitted on the contexts the workers run (0, 0).
    decode_per_context_s: float = 0.0
    context_tokens: float = 0.0

    def prefill_s(self, tokens: float) -> float:
        return self.prefill(tokens) * self.prefill_factor if tokens > 0 else 0.0

    def step_s(self, num_seqs: int) -> float:
        n = max(num_seqs, 1)
        return (self.decode(n) + n * self.context_tokens * self.decode_per_context_s
                ) * self.decode_factor

    def max_batch(self, tpot_s: float) -> int:
        """The largest batch whose step fits in tpot_s (0 when not even one does)."""
        lo, hi = 0, self.max_num_seqs  # step_s is non-decreasing: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.step_s(mid) <= tpot_s else (lo, mid - 1)
        return lo


def prefill_service(demand: Demand, curves: Curves, quantile: float,
                    unknown_cv2: float) -> Service:
    """The prefill time S(L) = a + b L + c L^2 of a prompt of random length L, its tail at
    `quantile`.

    With `demand.prompt_cv` unknown, L is its mean: S(mean), and `unknown_cv2` stands for
    the spread (PlannerConfig.service_cv2). Else L is lognormal with that mean m and cv
    (real prompt lengths are skewed: a few long prompts and many short ones), whose raw
    moments are m^k (1 + cv^2)^(k(k-1)/2), so

      E[S]   = a + b m1 + c m2
      E[S^2] = a^2 + 2ab m1 + (b^2 + 2ac) m2 + 2bc m3 + c^2 m4
      tail   = S(L_q), L_q = exp(mu + sigma z_q), sigma^2 = ln(1 + cv^2),
               mu = ln m - sigma^2 / 2

    The quadratic (attention) term makes the mean prefill of a spread of prompts longer
    than the mean prompt's, and its spread lengthens every queue (cs^2 in the wait). cv 0
    is the fixed length: S(m), cs^2 = 0. The lognormal has no context limit: for a trace
    with cv ~1 (goodput table (c)) its mean and p90 prefill match the trace's within a
    few %, its cs^2 overstates the trace's (~2 vs 3.6 where attention is a third of a
    2K-token prefill), so queues are judged a little long."""
    mean = demand.prompt_tokens
    if mean <= 0:
        return Service(0.0, 0.0, 0.0)
    if demand.prompt_cv is None:
        one = curves.prefill_s(mean)
        return Service(one, unknown_cv2, one)
    spread = 1 + demand.prompt_cv ** 2
    m1, m2, m3, m4 = (mean ** k * spread ** (k * (k - 1) / 2) for k in range(1, 5))
    a, b, c = curves.prefill
    factor = curves.prefill_factor
    first = (a + b * m1 + c * m2) * factor
    second = (a * a + 2 * a * b * m1 + (b * b + 2 * a * c) * m2 + 2 * b * c * m3
              + c * c * m4) * factor ** 2
    sigma = math.sqrt(math.log(spread))
    tail = math.exp(math.log(mean) - sigma ** 2 / 2
                    + sigma * NormalDist().inv_cdf(quantile))
    cv2 = max(second / first ** 2 - 1, 0.0) if first > 0 else 0.0
    return Service(first, cv2, curves.prefill_s(tail))


def _service(demand: Demand, curves: Curves, config: PlannerConfig) -> Service:
    return prefill_service(demand, curves, config.attainment_target, config.service_cv2)


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


def ttft_quantile(rate: float, service: Service, servers: int, config: PlannerConfig) -> float:
    """Wait and prefill at the quantile: the quantile wait plus the quantile prompt's
    prefill (the two add up at the extremes: at a light load the wait is 0 and the TTFT
    quantile is the long prompt's; at a heavy one the wait dominates)."""
    return wait_quantile(rate, service, servers, config) + service.tail_s


def fit_disagg(demand: Demand, curves: Curves, num_prefill: int, num_decode: int,
               config: PlannerConfig, prefill: Curves | None = None) -> Fit:
    """`prefill`: the prefill workers' curves where they differ from the decode
    workers' (a prefill worker that borrows decode cores: layout.borrowing_curves)."""
    service = _service(demand, prefill or curves, config)
    ttft = ttft_quantile(demand.prefill_rate, service, num_prefill, config)
    per_worker = math.ceil(demand.sequences(config.slo_tpot_s) / num_decode)
    tpot = curves.step_s(per_worker) if per_worker <= curves.max_num_seqs else INF
    return Fit(ttft, tpot)


def fit_agg(demand: Demand, curves: Curves, num_workers: int, config: PlannerConfig) -> Fit:
    """Colocated: each worker's decode steps share it with the prompts it prefills.

    TPOT is a request's, at the attainment quantile, not the mean: every prompt its
    worker prefills while it decodes stalls it by that prompt's whole prefill (chunks
    interleave with its steps; they do not get shorter), so with K such prompts its TPOT
    is D(n) + K S / output. They are the prompts that reach its worker after it and
    before it ends (they queue behind it): Poisson(lambda_p / c x T) of them, T its mean
    wait, its own prefill and its decode (output x D(n)), and each stretches its decode
    by S, in which rho = lambda_p S / c more arrive: a branching process
    (queueing.progeny_quantile). The fluid mean D(n) / (1 - rho) is a floor. With long
    prompts and short outputs one collision is already a large TPOT, which the mean
    hides (goodput table (a), where a request's wait and prefill are most of T)."""
    per_worker = math.ceil(demand.sequences(config.slo_tpot_s) / num_workers)
    if per_worker > curves.max_num_seqs:
        return Fit(INF, INF)
    service = _service(demand, curves, config)
    step = curves.step_s(per_worker)
    prefill_share = demand.prefill_rate * service.mean_s / num_workers
    if prefill_share >= 1:
        return Fit(INF, INF)
    outputs = max(demand.output_tokens, 1.0)
    # A prompt rides one step with the running batch: its service includes that step.
    riding = _riding(service, step)
    exposure = (mean_wait(demand.prefill_rate, riding, num_workers, config) + riding.mean_s
                + outputs * step)
    collisions = progeny_quantile(demand.prefill_rate / num_workers * exposure,
                                  prefill_share, config.attainment_target)
    tpot = max(step / (1 - prefill_share), step + collisions * service.mean_s / outputs)
    ttft = ttft_quantile(demand.prefill_rate, riding, num_workers, config)
    return Fit(ttft, tpot)


def _riding(service: Service, step_s: float) -> Service:
    """A colocated prompt's service: its prefill and the decode step it rides."""
    return service.plus(step_s) if service.mean_s > 0 else service


def local_share(demand: Demand, curves: Curves, num_prefill: int, num_decode: int,
                config: PlannerConfig, router: RouterConfig = RouterConfig(),
                kv: KVLayout = KVLayout(), pace_s: float | None = None) -> float:
    """The share f of prompts the decode workers of a mixed layout prefill themselves
    (fit_mixed's docstring); the rest go to the prefill pool; `pace_s`: theirs, if any."""
    rate = demand.prefill_rate
    service = _service(demand, curves, config)
    mean_s = service.mean_s
    per_worker = math.ceil(demand.sequences(config.slo_tpot_s) / num_decode)
    if per_worker > curves.max_num_seqs:
        return 0.0
    step = curves.step_s(per_worker)
    window = router.tpot_window_tokens
    slack = 1 - (max(step, pace_s or 0.0) + mean_s / window) / config.slo_tpot_s  # u's most
    if slack <= 0:
        return 0.0
    most = 1.0 if rate * mean_s <= 0 else min(1.0, slack * num_decode / (rate * mean_s))
    stall = per_worker * mean_s / window
    transfer = (router.transfer_latency_s + demand.prompt_tokens * kv.kv_bytes_per_token
                / router.transfer_bandwidth_bytes_s)
    weight = router.load_weight

    def cheaper_locally(share: float) -> bool:
        local = mean_wait(share * rate, service.plus(step), num_decode, config)
        remote = mean_wait((1 - share) * rate, service, num_prefill, config)
        return weight * (local + stall) <= weight * remote + transfer

    if cheaper_locally(most):
        return most
    if not cheaper_locally(0.0):
        return 0.0
    lo, hi = 0.0, most  # cheaper_locally holds up to a point, then fails: bisect
    for _ in range(_SHARE_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cheaper_locally(mid) else (lo, mid)
    return lo


def fit_mixed(demand: Demand, curves: Curves, num_prefill: int, num_decode: int,
              config: PlannerConfig, router: RouterConfig = RouterConfig(),
              kv: KVLayout = KVLayout(), prefill: Curves | None = None,
              pace_s: float | None = None) -> Fit:
    """P prefill + D decode workers under the router's conditional disaggregation
    (--disagg-policy auto, tpot_slo_s = slo_tpot_s): a fluid model of its rule
    (router.py's docstring). Per decode worker, with lambda = prefill_rate, S = S(prompt),
    n = ceil(N / D) sequences (N as in fit_disagg), step = D(n), W = tpot_window_tokens:

      local prefill utilisation  u = f lambda S / D
      TPOT rule   step' + (recent + S) / W <= slo_tpot, recent = u W slo_tpot (the local
                  prefills of the TPOT horizon), i.e. u <= 1 - (step' + S / W) / slo_tpot,
                  step' = max(step, pace_s) (a pacing decode worker's token interval)
      cost rule   local when its cost is lower: the decode step and the prefill are on
                  both sides, so load_weight (w_D + n S / W) <= load_weight w_P + transfer,
                  w_D, w_P the mean waits of the local (service S + step, D servers, rate
                  f lambda) and remote (S, P servers, (1 - f) lambda) queues
      f           the largest share in [0, 1] meeting both (the cost rule holds up to a
                  share, as the local wait grows with f and the remote one shrinks)
      TPOT        step / (1 - u)                                        (as fit_agg)
      TTFT        the worse of the local path, wait_q(f lambda, S + step, D) + S_q + step
                  (the prompt rides a step, as fit_agg), and the remote one,
                  wait_q((1 - f) lambda, S, P) + S_q (as fit_disagg)

    S is the mean prefill over the prompt lengths and S_q the quantile prompt's
    (prefill_service; both S(prompt) when its spread is unknown). f = 0 is fit_disagg
    exactly; f = 1 has fit_agg's TPOT on the D workers.
    Not modeled: which prompts go local ("short prompts go local" is a share f of prompts
    of the mean cost, not a length threshold); KV transfer time in TTFT (only in the cost
    rule); local prefills when every prefill worker is over budget (the router's spill);
    the memory terms of the costs. The router's knobs and KV bytes per token are `router`
    and `kv`; `prefill`: the prefill workers' curves where they differ (fit_disagg: the
    remote TTFT uses them, local_share the decode workers' on both sides)."""
    share = local_share(demand, curves, num_prefill, num_decode, config, router, kv, pace_s)
    if share <= 0:
        return fit_disagg(demand, curves, num_prefill, num_decode, config, prefill)
    rate = demand.prefill_rate
    service = _service(demand, curves, config)
    step = curves.step_s(math.ceil(demand.sequences(config.slo_tpot_s) / num_decode))
    tpot = step / (1 - share * rate * service.mean_s / num_decode)
    ttft = ttft_quantile(share * rate, _riding(service, step), num_decode, config)
    if share < 1:
        remote = _service(demand, prefill, config) if prefill else service
        ttft = max(ttft, ttft_quantile((1 - share) * rate, remote, num_prefill, config))
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
    service = _service(demand, curves, config)
    num_p, p_ok = _smallest(
        lambda c: ttft_quantile(demand.prefill_rate, service, c, config) <= config.slo_ttft_s,
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
