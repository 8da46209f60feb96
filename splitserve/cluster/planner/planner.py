"""The planner's logic (DESIGN.md 9): every interval, from what the cluster measured, the
layout and pool sizes that meet the TTFT and TPOT SLOs within the budget, and the ordered
steps to get there. No I/O: the frontend calls `Planner.step` and an actuator carries out
the steps through the Runtime.

The model, per interval k (rates in requests/s, times in seconds):

1. Load. x_k = arrivals / duration, smoothed by Holt's method with a damped trend
   (Gardner-McKenzie, phi = damping):
       L_k = alpha x_k + (1 - alpha)(L_{k-1} + phi T_{k-1})
       T_k = beta (L_k - L_{k-1}) + (1 - beta) phi T_{k-1}
       F(h) = max(0, L_k + (phi + phi^2 + ... + phi^h) T_k)
   sized for lambda = max(L_k, F(1 + model_load_s / interval_s)): on a rising trend, the
   load when a worker started now first serves; never below the level (a falling trend
   shrinks nothing early). model_load_s is the cluster's measured start-to-serving
   time when the observation carries one (load_time.py). Prompt (uncached) and output
   lengths are EWMAs, and so is the prompt lengths' coefficient of variation (measured
   in intervals with 2+ arrivals). After `idle_intervals` with no arrivals and nothing in flight the
   pools go to their minimums, cooldowns and windows aside, and the forecast restarts
   from the next load.
2. Capacity. The pool's curves average the coefficients of the warm workers' own fits:
   prefill S(t) = a + b t + c t^2, decode step D(n) = a + b n + c n^2. Warming workers
   count in their pool's size (they were started for a reason) but never in its curves.
   With no warm fit: the last pooled curves, else the configured priors.
3. Prefill pool as a G/G/c queue: lambda_p = lambda + backlog / interval, S the mean
   prefill over the prompt lengths, offered load a = lambda_p S < c. M/M/c gives
   P(W > t) = C(c, a) exp(-(c/S - lambda_p) t) (Erlang C), so the q-quantile wait is
   w_q = ln(C / (1 - q)) / (c/S - lambda_p), 0 when C <= 1 - q, scaled by
   (ca^2 + cs^2) / 2 (Allen-Cunneen). Need TTFT_q = w_q + S_q <= SLO, S_q the q-quantile
   prompt's prefill. With a measured spread the prompt lengths are lognormal
   (capacity.prefill_service: S, cs^2 and S_q from the curve in closed form); before
   one, S = S_q = S(mean prompt) and cs^2 = service_cv2.
4. Decode pool: n* = max{n <= max_num_seqs : D(n) <= SLO_tpot}; concurrent sequences
   N = max(lambda * output * SLO_tpot, running now) (Little's law at the SLO's pace, an
   upper bound); workers = ceil(N / n*); predicted TPOT = D(ceil(N / workers)).
5. Colocated ("agg"), c workers: n = ceil(N / c), prefill share rho = lambda_p S / c.
   Every prompt a worker prefills while a request decodes there stalls that request by
   S: TPOT_q = max(D(n) / (1 - rho), D(n) + k_q S / output), k_q the q-quantile of its
   collisions: the prompts that arrive after it and before it ends, Poisson(lambda_p / c
   x (mean wait + S + output x D(n))) first ones, each stretching its decode by S in
   which Poisson(rho) more arrive (a branching family, queueing.progeny_quantile). A
   prompt rides a step with the running batch: TTFT as in 3 with service S + D(n).
6. Choice, with headroom h = max(band, noise_z * sigma), sigma the measured relative
   noise of the token rates (prompt and output tokens/s) from one interval to the next:
   1.4826 / sqrt(2) x the median |log ratio| of consecutive intervals over the last 12,
   so a step in the load (one large ratio) is followed, not taken for noise. Both
   layouts are sized at lambda, (1 + h) lambda and (1 + 2h) lambda. The layout changes
   only to one that meets the SLOs and needs fewer workers at (1 + h) lambda (or when
   the current one cannot meet them). In a layout a pool short at lambda grows to its
   need at (1 + h) lambda; it shrinks only when its need at (1 + 2h) lambda stayed below
   its size for scale_down_window_s, to the largest of those needs. So growth lands h
   above the load, and shrinking waits for the load to fall about h below where growth
   landed: noise within h moves nothing. Cooldowns gate both, and the budget beats both.
   Needs over the budget: split in proportion to the needs (a split off by one worker
   is kept).
7. Measured attainment below target while the model says the current counts meet that
   SLO (and nothing is warming) means a curve is optimistic: a TTFT miss scales the
   prefill curve, a TPOT miss the decode curve, by 1.25 (at most 4x); each interval on
   target decays the scale 10% toward 1.

Ignored: KV memory (decode batches are bounded by max_num_seqs only); KV transfer and
network time in TTFT; worker heterogeneity (curves are averaged); the prompt length
distribution beyond its mean and spread (a lognormal stands for it); decode workers
prefilling short prompts locally; several prompts sharing one prefill step (so TTFT is
pessimistic); what drains and role switches cost while they run (the actuator's part).
"""
from __future__ import annotations

import math
from collections import Counter, deque

from splitserve.cluster.planner import capacity
from splitserve.cluster.planner.capacity import Curves, Demand, Sizing
from splitserve.cluster.planner.forecast import LoadForecast
from splitserve.cluster.planner.model import (Decision, Layout, Observation, PlannerConfig,
                                              WorkerSample)
from splitserve.cluster.planner.steps import plan_steps
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import Quadratic

_NEVER = float("-inf")
_CORRECTION_STEP = 1.25
_CORRECTION_MAX = 4.0
_CORRECTION_DECAY = 0.9
_POOLS = ("prefill", "decode")  # in the colocated layout its workers are "decode"


def _average(curves: list[Quadratic]) -> Quadratic | None:
    if not curves:
        return None
    n = len(curves)
    return Quadratic(sum(q.a for q in curves) / n, sum(q.b for q in curves) / n,
                     sum(q.c for q in curves) / n)


def _fmt(seconds: float) -> str:
    return "inf" if seconds == capacity.INF else f"{seconds:.3f}s"


class Planner:
    """Stateful across intervals: the load forecast, the last pooled curves, the
    correction factors, each pool's last growth and change (cooldowns) and its recent
    shrink needs (the window). Cooldowns run
    from decisions issued, acted on or not, so advisory mode logs what would be done."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._forecast = LoadForecast(config.alpha, config.beta, config.damping,
                                      noise_prior=config.noise_prior)
        self._prefill: Quadratic = config.prior_prefill
        self._decode: Quadratic = config.prior_decode
        self._max_num_seqs = config.default_max_num_seqs
        self._factors = {"prefill": 1.0, "decode": 1.0}  # per curve, see 7.
        self._last_up = dict.fromkeys(_POOLS, _NEVER)
        self._last_change = dict.fromkeys(_POOLS, _NEVER)
        # Each pool's needs at twice the headroom over the last scale_down_window_s: a
        # pool shrinks only to the largest (Kubernetes' downscale stabilization window).
        window = max(1, math.ceil(config.scale_down_window_s / config.interval_s))
        self._recent: dict[str, deque[int]] = {p: deque(maxlen=window) for p in _POOLS}

    def step(self, obs: Observation) -> Decision:
        """The decision for the interval that `obs` closes."""
        cfg = self.config
        roles = Counter(w.role for w in obs.workers)
        layout = Layout.AGG if roles[Role.BOTH] and not roles[Role.PREFILL] else Layout.DISAGG
        current = (roles[Role.PREFILL], roles[Role.DECODE] + roles[Role.BOTH])
        in_flight = sum(w.num_running + w.num_waiting for w in obs.workers)
        self._forecast.observe(obs.num_arrivals / obs.duration_s, obs.num_arrivals,
                               obs.mean_prompt_tokens, obs.mean_output_tokens,
                               is_idle=obs.num_arrivals == 0 and in_flight == 0,
                               prompt_cv=obs.prompt_cv)
        num_warming = sum(w.warming for w in obs.workers)
        reasons = [f"measured: {obs.num_arrivals} arrivals in {obs.duration_s:.1f}s, "
                   f"prompt {self._forecast.prompt_tokens:.0f} tok, output "
                   f"{self._forecast.output_tokens:.0f} tok (smoothed); {layout.value} "
                   f"{current[0]}P+{current[1]}D, {num_warming} warming, {in_flight} in flight"]
        self._update_curves(obs.workers, reasons)
        demand = self._demand(obs)
        self._correct(obs, layout, current, demand, num_warming, reasons)
        curves = self._curves()

        if self._forecast.num_idle >= cfg.idle_intervals:
            self._forecast.reset_rate()
            target = (0 if layout is Layout.AGG else cfg.min_prefill, cfg.min_decode)
            reasons.append(f"idle for {cfg.idle_intervals} intervals: pools to their minimums")
            for recent in self._recent.values():
                recent.clear()
        else:
            layout, target = self._choose(obs.now, layout, current, demand, curves, reasons)

        counts = ({Role.BOTH: target[1]} if layout is Layout.AGG
                  else {Role.PREFILL: target[0], Role.DECODE: target[1]})
        steps = plan_steps(obs.workers, counts, cfg.budget, cfg.allow_role_switch)
        self._record(obs.now, current, target)
        fit = capacity.fit_at(layout, demand, curves, target[0], target[1], cfg)
        if steps:
            reasons.append(f"change: {current[0]}P+{current[1]}D -> {layout.value} "
                           f"{target[0]}P+{target[1]}D in {len(steps)} steps")
        return Decision(layout, target[0], target[1], tuple(steps), demand.rate,
                        fit.ttft_s, fit.tpot_s, tuple(reasons))

    # -- inputs -----------------------------------------------------------------------

    def _update_curves(self, workers: tuple[WorkerSample, ...], reasons: list[str]) -> None:
        warm = [w for w in workers if not w.warming]
        prefill = _average([w.prefill for w in warm if w.prefill is not None])
        decode = _average([w.decode for w in warm if w.decode is not None])
        self._prefill = prefill or self._prefill
        self._decode = decode or self._decode
        # Decode batches are bounded by the smallest decoding worker's max_num_seqs.
        decoders = [w for w in warm if w.role is not Role.PREFILL]
        if decoders:
            self._max_num_seqs = min(w.max_num_seqs for w in decoders)
        reasons.append(f"capacity from {len(warm)} warm workers: prefill {self._prefill}, "
                       f"decode step {self._decode}, max batch {self._max_num_seqs}")

    def _curves(self) -> Curves:
        return Curves(self._prefill, self._decode, self._max_num_seqs,
                      self._factors["prefill"], self._factors["decode"])

    def _demand(self, obs: Observation) -> Demand:
        cfg, fc = self.config, self._forecast
        load_s = cfg.model_load_s if obs.model_load_s is None else obs.model_load_s
        ahead = 1 + load_s / cfg.interval_s
        # Never below the level: a falling trend lowers nothing (the level lags: shrinking
        # is a little late, never early).
        rate = max(fc.level, fc.rate_in(ahead))
        backlog = sum(w.num_waiting for w in obs.workers)
        running = sum(w.num_running for w in obs.workers if w.role is not Role.PREFILL)
        return Demand(rate, fc.prompt_tokens, fc.output_tokens, backlog, running,
                      cfg.interval_s, fc.prompt_cv)

    def _correct(self, obs: Observation, layout: Layout, current: tuple[int, int],
                 demand: Demand, num_warming: int, reasons: list[str]) -> None:
        """Scale a pool's curve up when measurement beats the model at its own claim."""
        cfg = self.config
        fit = capacity.fit_at(layout, demand, self._curves(), current[0], current[1], cfg)
        # TTFT is mostly the prefill curve's (in either layout), TPOT the decode curve's.
        checks = (("prefill", obs.ttft_attainment, fit.ttft_s <= cfg.slo_ttft_s, "TTFT"),
                  ("decode", obs.tpot_attainment, fit.tpot_s <= cfg.slo_tpot_s, "TPOT"))
        for curve, attained, predicted_ok, metric in checks:
            if attained is None:
                continue
            factor = self._factors[curve]
            if attained >= cfg.attainment_target:
                self._factors[curve] = 1 + (factor - 1) * _CORRECTION_DECAY
            elif predicted_ok and num_warming == 0:
                self._factors[curve] = min(factor * _CORRECTION_STEP, _CORRECTION_MAX)
                reasons.append(f"{metric} attainment {attained:.2f} < "
                               f"{cfg.attainment_target:.2f} where the model predicted it "
                               f"met: {curve} curve x{self._factors[curve]:.2f}")

    # -- the choice -------------------------------------------------------------------

    def _choose(self, now: float, layout: Layout, current: tuple[int, int], demand: Demand,
                curves: Curves, reasons: list[str]) -> tuple[Layout, tuple[int, int]]:
        cfg = self.config
        head = min(1.0, max(cfg.band, cfg.noise_z * self._forecast.noise))
        layouts = [Layout.DISAGG] + ([Layout.AGG] if cfg.allow_colocated else [])
        need, grow, shrink = ({lay: capacity.size(lay, demand.scaled(1 + k * head), curves, cfg)
                               for lay in layouts} for k in (0, 1, 2))
        reasons.append(f"forecast {demand.rate:.2f}/s (level {self._forecast.level:.2f}, "
                       f"trend {self._forecast.trend:+.2f}/interval, noise "
                       f"{self._forecast.noise:.0%}, headroom {head:.0%}), backlog "
                       f"{demand.backlog}, running {demand.running}")
        reasons += [self._describe(need[lay], grow[lay]) for lay in layouts]

        if layout not in need:  # colocated now, no longer allowed: back at once
            reasons.append("layout agg -> disagg: colocation is not allowed")
            return self._switch(grow[Layout.DISAGG])
        other = Layout.AGG if layout is Layout.DISAGG else Layout.DISAGG
        if other in need and need[other].is_feasible and (
                not need[layout].is_feasible or grow[other].total < grow[layout].total):
            wait = max(self._last_change.values()) + cfg.scale_down_cooldown_s - now
            if wait <= 0:
                chosen = grow[other] if grow[other].is_feasible else need[other]
                reasons.append(f"layout {layout.value} -> {other.value}: meets the SLOs "
                               f"with {chosen.total} workers")
                return self._switch(chosen)
            reasons.append(f"layout {other.value} is better; held by cooldown ({wait:.0f}s)")

        plan = need[layout]
        if (layout is Layout.DISAGG and not plan.is_feasible and plan.total == sum(current)
                == cfg.budget and abs(plan.num_prefill - current[0]) <= 1):
            # Short at the budget, the split follows the needs' ratio, which noise moves
            # by a worker either way: only a larger move is worth a switch.
            reasons.append(f"over budget: keeping the split {current[0]}P+{current[1]}D")
            return layout, current
        for pool, count in zip(_POOLS, (shrink[layout].num_prefill, shrink[layout].num_decode)):
            self._recent[pool].append(count)
        wanted = (need[layout].num_prefill, need[layout].num_decode)
        target = [self._hold(now, pool, current[i], wanted[i],
                             (grow[layout].num_prefill, grow[layout].num_decode)[i],
                             max(self._recent[pool]), reasons)
                  for i, pool in enumerate(_POOLS)]
        if layout is Layout.AGG:
            target[0] = 0
        # The budget beats hysteresis: give back held surplus, the pool above its need.
        for i in (0, 1):
            over = sum(target) - cfg.budget
            if over > 0:
                target[i] -= min(over, max(0, target[i] - wanted[i]))
        return layout, (target[0], target[1])

    def _switch(self, sizing: Sizing) -> tuple[Layout, tuple[int, int]]:
        # The window's needs were the old layout's; they bind the new one no more.
        for recent in self._recent.values():
            recent.clear()
        return sizing.layout, (sizing.num_prefill, sizing.num_decode)

    def _hold(self, now: float, pool: str, current: int, wanted: int, grown: int,
              shrunk: int, reasons: list[str]) -> int:
        """Hysteresis and cooldowns for one pool: grow when short at the forecast, to the
        need at one headroom; shrink only when even two headrooms need fewer throughout
        the window, to that need. Between the two the count holds."""
        cfg = self.config
        if wanted > current:
            wait = self._last_up[pool] + cfg.scale_up_cooldown_s - now
            if wait <= 0:
                return max(wanted, grown)
            reasons.append(f"{pool}: growth to {max(wanted, grown)} held by cooldown "
                           f"({wait:.0f}s)")
        elif shrunk < current:
            wait = self._last_change[pool] + cfg.scale_down_cooldown_s - now
            if wait <= 0:
                return shrunk
            reasons.append(f"{pool}: shrink to {shrunk} held by cooldown ({wait:.0f}s)")
        elif wanted < current:
            reasons.append(f"{pool}: hold {current} (needs {wanted}; {shrunk} at twice the "
                           f"headroom over the last {cfg.scale_down_window_s:.0f}s)")
        return current

    def _describe(self, need: Sizing, grow: Sizing) -> str:
        ok = "meets the SLOs" if need.is_feasible else "cannot meet the SLOs in bounds"
        return (f"{need.layout.value}: {need.num_prefill}P+{need.num_decode}D ({ok}: TTFT "
                f"{_fmt(need.fit.ttft_s)} at p{self.config.attainment_target * 100:.0f}, TPOT "
                f"{_fmt(need.fit.tpot_s)}); {grow.num_prefill}P+{grow.num_decode}D "
                f"with headroom")

    def _record(self, now: float, current: tuple[int, int], target: tuple[int, int]) -> None:
        for pool, before, after in zip(_POOLS, current, target):
            if after > before:
                self._last_up[pool] = now
            if after != before:
                self._last_change[pool] = now
