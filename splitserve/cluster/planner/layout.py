"""`--mode auto`: which layout serves the most on this machine's cores, chosen once at
startup from measured cost curves (profile.py) by the planner's capacity model.

Candidates on `cores` cores, each worker on its own even share of them (as the launcher
pins workers):
    agg xN        N colocated workers, cores / N threads each     (N divides cores)
    disagg P+D    P prefill + D decode workers, cores / (P + D) threads each, every prompt
                  prefilled on the prefill pool (--disagg-policy always)
    mixed P+D     the same workers under the router's conditional disaggregation
                  (--disagg-policy auto): decode workers prefill the prompts that keep
                  their running sequences within the TPOT target and cost less locally;
                  the rest (long prompts, busy decode workers) go to the prefill pool
With --threads-per-worker T every worker runs T threads and at most cores / T exist.
Without it, and with --prefill-borrows-cores (the default), a prefill worker also borrows its
share of the decode workers' cores (cluster/specs.py): its prefill curve is then the one
measured at all its threads while the decode workers are idle and its own cores' while they
step, blended by the share of time they step at the rate scored (decode_busy: the chance a
decode worker holds a sequence, Poisson of mean rate x output x step; with --slo-tpot-ms
its decode worker paces its steps while the prefill has prompts: a step's share of each
pace then). Where that thread
count was not measured (an uneven share) the prefill worker is scored on its own cores.
Each candidate's score is the highest request rate at which capacity.py predicts that
the SLO quantile of TTFT and TPOT is met (capacity.fit_agg, fit_disagg, fit_mixed:
queueing and prefill interference included). The best wins, except within 10% of it
(a gain within the noise of the model):
- a colocated layout wins over the others: fewer moving parts;
- else mixed wins over disagg. Both start the same processes and the model cannot tell
  them apart, so what it leaves out decides: under auto the router chooses per request
  from live costs and keeps a prompt remote whenever a local prefill would break the
  TPOT budget (so mixed is disagg where local prefills do not pay: its local share is 0
  there), prefills locally when every prefill worker is full where always would queue,
  and moves fewer KV caches, whose transfer time neither model counts in TTFT. (The
  router gets the TPOT target the choice was scored at: auto_layout.router_tpot_slo_s.)
When no candidate meets the SLOs at any rate, the one closest to them unloaded wins and
the reason says so.

The prompt lengths: their mean, and their spread when the hint gives it (`PROMPT:OUTPUT:CV`,
a lognormal of that mean and coefficient of variation: capacity.prefill_service), which
lengthens the mean prefill (attention's quadratic term), every queue (the service's cs^2)
and the TTFT quantile (the long prompts' own prefill). Not modeled (as in the planner):
KV transfer time in TTFT, mixed's "short prompts local" as a length threshold (it is a
share of the prompts, each of the distribution's mean cost), and memory bandwidth shared
between workers (so many small workers are optimistic).
"""
from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from enum import Enum

from splitserve.cluster.planner import capacity
from splitserve.cluster.planner.capacity import Curves, Demand, Fit
from splitserve.cluster.planner.model import Layout, PlannerConfig
from splitserve.cluster.router.cost_model import Quadratic

TIE_SHARE = 0.9  # a colocated (else mixed) layout within 10% of the best is chosen
# Without SLOs: TTFT this many times the unloaded TTFT of the hint's prompt, TPOT this
# many times the unloaded decode step (batch 1), both of a worker at the fewest threads
# measured (one core's, unless --threads-per-worker): what one core does is the yardstick,
# and wider workers are judged against it.
DEFAULT_TTFT_FACTOR = 3.0
DEFAULT_TPOT_FACTOR = 2.0
_RATE_STEPS = 48  # bisection steps: the rate to ~1e-14 of its bracket
_MAX_RATE = 1e9  # requests/s: a bound for curves that cost nothing
MAX_PROMPT_CV = 10.0  # beyond this a lognormal's moments are no model of a workload


@dataclass(frozen=True)
class WorkloadHint:
    """The traffic to lay the machine out for: mean prompt and output tokens, and the
    prompt length's coefficient of variation (std / mean) when known (None: the prompts
    are taken as their mean; capacity.prefill_service)."""

    prompt_tokens: int
    output_tokens: int
    prompt_cv: float | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"workload hint {self.prompt_tokens}:{self.output_tokens} needs "
                             f"positive prompt and output tokens")
        if self.prompt_cv is not None and not 0 <= self.prompt_cv <= MAX_PROMPT_CV:
            raise ValueError(f"workload hint prompt cv {self.prompt_cv} must be in "
                             f"[0, {MAX_PROMPT_CV:g}] (std / mean of the prompt lengths)")

    def demand(self, rate: float, interval_s: float) -> Demand:
        """This traffic arriving at `rate` requests/s, nothing queued or running."""
        return Demand(rate, float(self.prompt_tokens), float(self.output_tokens), backlog=0,
                      running=0, interval_s=interval_s, prompt_cv=self.prompt_cv)

    def __str__(self) -> str:
        """e.g. "839+24-token requests (prompt cv 1.0)"."""
        text = f"{self.prompt_tokens}+{self.output_tokens}-token requests"
        return text if self.prompt_cv is None else f"{text} (prompt cv {self.prompt_cv:.2g})"


@dataclass(frozen=True)
class SLOTarget:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be positive seconds (TTFT {self.ttft_s}, "
                             f"TPOT {self.tpot_s})")


class Shape(str, Enum):
    """A candidate's kind: the workers it starts (a planner Layout, which the planner also
    scales) and the router's disaggregation policy. The values are log and metric labels."""

    AGG = "agg"  # colocated workers (Role.BOTH)
    DISAGG = "disagg"  # prefill + decode pools, every prompt remote
    MIXED = "mixed"  # prefill + decode pools, decode workers prefill what fits locally

    @property
    def layout(self) -> Layout:
        return Layout.AGG if self is Shape.AGG else Layout.DISAGG

    @property
    def disagg_policy(self) -> str:
        """The router's --disagg-policy for this kind."""
        return {Shape.AGG: "never", Shape.DISAGG: "always", Shape.MIXED: "auto"}[self]

    @staticmethod
    def of(mode: str, disagg_policy: str) -> Shape:
        """The kind an explicit --mode and --disagg-policy run: disagg under auto is the
        mixed layout."""
        if mode == "agg":
            return Shape.AGG
        return Shape.MIXED if disagg_policy == "auto" else Shape.DISAGG

    def label(self, num_prefill: int, num_decode: int) -> str:
        """e.g. "agg x2", "disagg 1P+1D", "mixed 1P+1D"."""
        if self is Shape.AGG:
            return f"agg x{num_decode}"
        return f"{self.value} {num_prefill}P+{num_decode}D"


# Within TIE_SHARE of the best the highest wins: colocated, then mixed (module docstring).
_TIE_RANK = {Shape.AGG: 2, Shape.MIXED: 1, Shape.DISAGG: 0}


@dataclass(frozen=True)
class Candidate:
    """One layout and what the model predicts for it."""

    shape: Shape
    num_prefill: int  # 0 when colocated
    num_decode: int  # the colocated workers in the agg layout
    threads: int  # torch threads per worker
    max_rate: float  # requests/s at which the SLOs are still met (0: not even unloaded)
    unloaded: Fit  # TTFT and TPOT at a vanishing rate

    @property
    def layout(self) -> Layout:
        return self.shape.layout

    @property
    def label(self) -> str:
        shape = self.shape.label(self.num_prefill, self.num_decode)
        return shape if self.threads == 1 else f"{shape} ({self.threads} threads)"


@dataclass(frozen=True)
class LayoutChoice:
    """The layout `splitserve serve` runs, and why: what /metrics and /admin/health show."""

    shape: Shape
    num_prefill: int
    num_decode: int
    threads_per_worker: int | None  # None: one per pinned core (not chosen here)
    disagg_policy: str  # the router's: "never" when colocated
    reason: str
    candidates: tuple[Candidate, ...] = ()  # empty when nothing was compared
    slo: SLOTarget | None = None  # the targets the candidates were scored at
    slo_derived: bool = False  # no SLO flags: targets from the measured costs

    @property
    def layout(self) -> Layout:
        """The workers to start (ServeConfig.mode)."""
        return self.shape.layout

    @property
    def label(self) -> str:
        return self.shape.label(self.num_prefill, self.num_decode)

    def to_dict(self) -> dict[str, object]:
        return {"layout": self.shape.value, "prefill": self.num_prefill,
                "decode": self.num_decode, "threads_per_worker": self.threads_per_worker,
                "disagg_policy": self.disagg_policy, "reason": self.reason,
                "slo": asdict(self.slo) if self.slo else None, "slo_derived": self.slo_derived,
                "candidates": [{"layout": c.label, "max_rate": c.max_rate,
                                "unloaded_ttft_s": c.unloaded.ttft_s,
                                "unloaded_tpot_s": c.unloaded.tpot_s}
                               for c in self.candidates]}


def candidate_shapes(cores: int, threads_per_worker: int | None = None
                     ) -> list[tuple[Shape, int, int, int]]:
    """(shape, prefill, decode, threads) of every candidate on `cores` cores."""
    if cores < 1:
        raise ValueError(f"cores={cores} must be >= 1")
    if threads_per_worker is not None:
        if threads_per_worker < 1:
            raise ValueError(f"threads_per_worker={threads_per_worker} must be >= 1")
        sizes = [(n, threads_per_worker)
                 for n in range(1, max(1, cores // threads_per_worker) + 1)]
    else:
        sizes = [(n, cores // n) for n in range(1, cores + 1) if cores % n == 0]
    shapes = [(Shape.AGG, 0, n, t) for n, t in sizes]
    shapes += [(kind, p, n - p, t) for n, t in sizes for p in range(1, n)
               for kind in (Shape.DISAGG, Shape.MIXED)]
    return shapes


def candidate_threads(cores: int, threads_per_worker: int | None = None) -> list[int]:
    """The thread counts whose cost curves choose_layout needs, ascending."""
    return sorted({t for *_, t in candidate_shapes(cores, threads_per_worker)})


def at_context(curves_by_threads: Mapping[int, Curves], workload: WorkloadHint
               ) -> dict[int, Curves]:
    """The curves with their decode steps costed at the workload's mean context over a
    decode: its prompt and half its output."""
    context = workload.prompt_tokens + workload.output_tokens / 2
    return {t: c._replace(context_tokens=context) for t, c in curves_by_threads.items()}


def default_slo(curves_by_threads: Mapping[int, Curves], workload: WorkloadHint,
                quantile: float = PlannerConfig.attainment_target) -> SLOTarget:
    """Targets from the measured costs, for when none are given (see the factors): the
    TTFT's yardstick is the prefill of the hint's prompt at the attainment quantile (its
    mean prompt when no spread is given); the TPOT's, a batch-1 step at the workload's
    mean context."""
    curves = at_context(curves_by_threads, workload)[min(curves_by_threads)]
    prompt = capacity.prefill_service(workload.demand(0.0, 1.0), curves, quantile,
                                      unknown_cv2=0.0)
    return SLOTarget(DEFAULT_TTFT_FACTOR * prompt.tail_s,
                     DEFAULT_TPOT_FACTOR * curves.step_s(1))


def lent_threads(num_prefill: int, num_decode: int, threads: int) -> int | None:
    """A borrowing prefill worker's threads: its own cores' and its share of the decode
    workers' (cluster/specs.py lend_cores); None when the share is uneven."""
    lent, rest = divmod(num_decode * threads, num_prefill)
    return None if rest or not lent else threads + lent


def decode_busy(curves: Curves, workload: WorkloadHint, rate: float, num_decode: int,
                pace_s: float | None = None) -> float:
    """The share of time a decode worker steps: the chance it holds a sequence, whose
    count is Poisson (M/G/inf) of mean rate x output tokens x step / decode workers. A
    pacing one (`pace_s`, cluster/worker/lending.py) holds each sequence a pace per token
    while the prefill has prompts, but computes only a step of each pace."""
    step = curves.step_s(1)
    if pace_s is None or pace_s <= step:
        return 1 - math.exp(-rate * workload.output_tokens * step / num_decode)
    held = rate * workload.output_tokens * pace_s / num_decode
    holding = 1 - math.exp(-held)
    batch = max(1, round(held / holding)) if holding else 1  # its mean while it holds any
    return holding * min(1.0, curves.step_s(batch) / pace_s)


def borrowing_curves(own: Curves, wide: Curves, busy: float) -> Curves:
    """A prefill worker on lent cores: its own cores' prefill curve the share `busy` of the
    time the decode workers step (the lent cores' threads preempted), the wide curve (all
    its cores) the rest."""
    blend = Quadratic(*((1 - busy) * w + busy * o for o, w in zip(own.prefill, wide.prefill)))
    return own._replace(prefill=blend)


def _fit(shape: Shape, curves: Curves, num_prefill: int, num_decode: int,
         workload: WorkloadHint, rate: float, config: PlannerConfig,
         wide: Curves | None = None, pace_s: float | None = None) -> Fit:
    """`wide`: a borrowing prefill worker's curves on all its cores (None: no borrowing);
    `pace_s`: the decode workers' pace (decode_busy)."""
    demand = workload.demand(rate, config.interval_s)
    prefill = None if wide is None or shape is Shape.AGG else borrowing_curves(
        curves, wide, decode_busy(curves, workload, rate, num_decode, pace_s))
    if shape is Shape.MIXED:
        if num_prefill < 1 or num_decode < 1:
            return Fit(capacity.INF, capacity.INF)
        return capacity.fit_mixed(demand, curves, num_prefill, num_decode, config,
                                  prefill=prefill, pace_s=pace_s if wide else None)
    if shape is Shape.DISAGG and prefill is not None:
        return capacity.fit_disagg(demand, curves, num_prefill, num_decode, config, prefill)
    return capacity.fit_at(shape.layout, demand, curves, num_prefill, num_decode, config)


def max_rate(shape: Shape, curves: Curves, num_prefill: int, num_decode: int,
             workload: WorkloadHint, config: PlannerConfig, wide: Curves | None = None,
             pace_s: float | None = None) -> float:
    """The highest arrival rate at which the predicted TTFT (at the attainment quantile)
    and TPOT meet config's SLOs; 0 when they are missed even unloaded. Predictions grow
    with the rate (more sequences per step, longer queues): bisect. (A pace is below the
    TPOT target: the TPOT is judged on the steps themselves.)"""
    def meets(rate: float) -> bool:
        fit = _fit(shape, curves, num_prefill, num_decode, workload, rate, config, wide,
                   pace_s)
        return fit.ttft_s <= config.slo_ttft_s and fit.tpot_s <= config.slo_tpot_s

    lo, hi = 0.0, 1e-3
    if not meets(hi):
        return 0.0
    while meets(hi) and hi < _MAX_RATE:  # servers saturate at a finite rate: this ends
        lo, hi = hi, hi * 2
    for _ in range(_RATE_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def choose_layout(curves_by_threads: Mapping[int, Curves], workload: WorkloadHint,
                  slo: SLOTarget | None, cores: int, *, threads_per_worker: int | None = None,
                  kinds: Collection[Shape] = tuple(Shape), borrow: bool = False,
                  pace_s: float | None = None) -> LayoutChoice:
    """The layout for `cores` cores (see the module docstring). `curves_by_threads`: one
    worker's cost curves at each thread count (candidate_threads says which are needed;
    a candidate whose count is missing is not considered). `slo` None: default_slo.
    `kinds`: the shapes to compare (agg always is). `borrow`: prefill workers borrow the
    decode workers' cores (ServeConfig.prefill_borrows_cores; not with a fixed
    threads_per_worker), modeled where the curves at their thread count were measured;
    `pace_s`: their decode workers' pace (ServeConfig.decode_pace_s; decode_busy).
    Decode steps are costed at the workload's mean context (at_context)."""
    curves_by_threads = at_context(curves_by_threads, workload)
    shapes = [s for s in candidate_shapes(cores, threads_per_worker)
              if s[3] in curves_by_threads and (s[0] in kinds or s[0] is Shape.AGG)]
    if not shapes:
        raise ValueError(f"no cost curves for any of the thread counts "
                         f"{candidate_threads(cores, threads_per_worker)} on {cores} cores")
    usable = {s[3]: curves_by_threads[s[3]] for s in shapes}
    derived = slo is None
    target = default_slo(usable, workload) if slo is None else slo
    config = PlannerConfig(slo_ttft_s=target.ttft_s, slo_tpot_s=target.tpot_s,
                           max_workers=max(2, cores))
    found = []
    for shape, num_p, num_d, threads in shapes:
        curves = curves_by_threads[threads]
        lent = (lent_threads(num_p, num_d, threads)
                if borrow and threads_per_worker is None and num_p else None)
        wide = curves_by_threads.get(lent) if lent else None
        found.append(Candidate(
            shape, num_p, num_d, threads,
            max_rate(shape, curves, num_p, num_d, workload, config, wide, pace_s),
            _fit(shape, curves, num_p, num_d, workload, 0.0, config, wide, pace_s)))
    best = max(found, key=lambda c: c.max_rate)
    if best.max_rate > 0:
        close = [c for c in found if c.max_rate >= TIE_SHARE * best.max_rate]
        chosen = max(close, key=lambda c: (_TIE_RANK[c.shape], c.max_rate))
    else:  # nothing meets them: the least over its targets unloaded
        chosen = min(found, key=lambda c: max(c.unloaded.ttft_s / target.ttft_s,
                                              c.unloaded.tpot_s / target.tpot_s))
    reason = _reason(chosen, best, found, workload, target,
                     min(usable) if derived else None, config.attainment_target)
    return LayoutChoice(chosen.shape, chosen.num_prefill, chosen.num_decode, chosen.threads,
                        chosen.shape.disagg_policy, reason, tuple(found), target, derived)


def _reason(chosen: Candidate, best: Candidate, found: list[Candidate],
            workload: WorkloadHint, slo: SLOTarget, derived: int | None,
            quantile: float) -> str:
    """e.g. "agg x2: 1.9 req/s vs disagg 1P+1D 1.2 req/s at TTFT 1000 ms / TPOT 80 ms for
    160+96-token requests"."""
    others = ", ".join(f"{c.label} {c.max_rate:.2g} req/s" for c in
                       sorted(found, key=lambda c: -c.max_rate) if c is not chosen)
    text = (f"{chosen.label}: {chosen.max_rate:.2g} req/s vs {others or 'no other'} at "
            f"TTFT {slo.ttft_s * 1000:.0f} ms / TPOT {slo.tpot_s * 1000:.0f} ms "
            f"(p{quantile * 100:.0f}) for {workload}")
    if best.max_rate == 0:
        text += "; no layout meets these SLOs even unloaded: the closest"
    elif chosen is not best and chosen.shape is Shape.AGG:
        text += (f"; within {1 - TIE_SHARE:.0%} of {best.label}: the colocated layout, "
                 f"fewer moving parts")
    elif chosen is not best:
        text += (f"; within {1 - TIE_SHARE:.0%} of {best.label}: {chosen.shape.value}, "
                 f"whose router keeps a prompt remote unless a local prefill is cheaper "
                 f"and within the TPOT target")
    if derived is not None:
        text += (f"; no SLO given: TTFT {DEFAULT_TTFT_FACTOR:g}x the unloaded prefill, TPOT "
                 f"{DEFAULT_TPOT_FACTOR:g}x the unloaded decode step of a {derived}-thread "
                 f"worker (set --slo-ttft-ms and --slo-tpot-ms)")
    return text
