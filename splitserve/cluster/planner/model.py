"""The planner's boundary as plain data: its configuration, what it is shown every
interval (`Observation` of `WorkerSample`s), and what it answers (`Decision` of `Step`s).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from splitserve.cluster.planner.load_time import DEFAULT_MODEL_LOAD_S
from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import CostModelConfig, Quadratic

_PRIORS = CostModelConfig()


class Layout(str, Enum):
    """How the workers are arranged. The values are log and metric labels."""
    DISAGG = "disagg"  # a prefill pool (Role.PREFILL) streams KV to a decode pool (DECODE)
    AGG = "agg"  # colocated: every worker prefills and decodes its own requests (BOTH)


class StepKind(str, Enum):
    ADD = "add"  # start a worker of `role`
    REMOVE = "remove"  # drain worker `worker_id` (of `from_role`) and stop it
    SWITCH = "switch"  # worker `worker_id` drains its `from_role` and serves as `role`


@dataclass(frozen=True)
class PlannerConfig:
    """SLOs, the budget and the damping. Counts are workers; a worker takes
    `cores_per_worker` cores, so a core budget `max_cores` caps the workers too."""

    slo_ttft_s: float
    slo_tpot_s: float
    max_workers: int
    interval_s: float = 10.0
    max_cores: int | None = None  # None: only max_workers bounds the total
    cores_per_worker: int = 1
    # Per-pool bounds in the disaggregated layout. In the colocated one the workers are
    # the decode pool for min_decode; the budget alone bounds them.
    min_prefill: int = 1
    max_prefill: int = 64
    min_decode: int = 1
    max_decode: int = 64
    # A pool grows at most once per scale_up_cooldown_s, and shrinks (or the layout
    # changes) only scale_down_cooldown_s after its last change of either kind.
    scale_up_cooldown_s: float = 10.0
    scale_down_cooldown_s: float = 30.0
    # Hysteresis. Headroom h = max(band, noise_z * the measured relative noise of the
    # load around its forecast; Poisson arrivals alone are 1/sqrt(arrivals)). A short pool
    # grows to its need at (1 + h) times the forecast; a pool shrinks only when its need
    # at (1 + 2h) times the forecast stayed below its size for scale_down_window_s (the
    # largest of those needs is what it shrinks to). A layout is left only for one that
    # needs fewer workers than the current one, both at (1 + h) times the forecast.
    band: float = 0.2
    noise_z: float = 1.5
    noise_prior: float = 0.2  # the relative noise assumed until a few intervals are measured
    scale_down_window_s: float = 120.0
    # Seconds from starting a worker to it serving: growth is sized for the load
    # forecast that far past the next interval.
    model_load_s: float = DEFAULT_MODEL_LOAD_S  # an Observation's measured one wins
    allow_colocated: bool = True
    allow_role_switch: bool = True  # a pool's surplus worker may switch to a short pool
    # The share of requests that must meet the TTFT SLO (the queueing quantile); also the
    # measured attainment below which the planner stops trusting its cost model.
    attainment_target: float = 0.9
    # Squared coefficients of variation of inter-arrival and prefill service times
    # (Allen-Cunneen): 1 and 1 is M/M/c; bursty traffic > 1; equal prompts 0.
    arrival_cv2: float = 1.0
    service_cv2: float = 1.0
    # Holt smoothing of the arrival rate (level, trend damped by `damping` per interval
    # ahead) and EWMA (alpha) of the lengths.
    alpha: float = 0.5
    beta: float = 0.2
    damping: float = 0.8
    # Intervals with no arrivals and nothing running before the pools go to their minimums.
    idle_intervals: int = 2
    # Used until some warm worker has fitted models of its own.
    prior_prefill: Quadratic = Quadratic(_PRIORS.prefill_fixed_s, _PRIORS.prefill_per_token_s, 0)
    prior_decode: Quadratic = Quadratic(_PRIORS.decode_step_base_s,
                                        _PRIORS.decode_step_per_seq_s, 0)
    default_max_num_seqs: int = 256

    def __post_init__(self) -> None:
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0 and self.interval_s > 0):
            raise ValueError("slo_ttft_s, slo_tpot_s and interval_s must be positive seconds")
        if not (1 <= self.min_prefill <= self.max_prefill and 1 <= self.min_decode
                <= self.max_decode):
            raise ValueError(f"need 1 <= min <= max per pool (prefill {self.min_prefill}.."
                             f"{self.max_prefill}, decode {self.min_decode}..{self.max_decode});"
                             f" for no prefill pool set allow_colocated")
        if self.min_prefill + self.min_decode > self.budget:
            raise ValueError(f"min_prefill + min_decode = {self.min_prefill + self.min_decode}"
                             f" workers exceed the budget of {self.budget}; raise max_workers"
                             f" or max_cores")
        if self.cores_per_worker < 1:
            raise ValueError(f"cores_per_worker={self.cores_per_worker} must be >= 1")
        if not (0 <= self.band < 1 and 0 < self.attainment_target < 1):
            raise ValueError("need 0 <= band < 1 and 0 < attainment_target < 1")
        if not (0 < self.alpha <= 1 and 0 <= self.beta <= 1 and 0 <= self.damping <= 1):
            raise ValueError("need 0 < alpha <= 1, 0 <= beta <= 1, 0 <= damping <= 1")
        if min(self.scale_up_cooldown_s, self.scale_down_cooldown_s, self.model_load_s,
               self.scale_down_window_s, self.arrival_cv2, self.service_cv2, self.noise_z,
               self.noise_prior) < 0 or self.idle_intervals < 1:
            raise ValueError("cooldowns, windows, model_load_s, CVs and noise terms must be "
                             ">= 0, idle_intervals >= 1")

    @property
    def budget(self) -> int:
        """The most workers that may exist at once (warming and draining ones included)."""
        if self.max_cores is None:
            return self.max_workers
        return min(self.max_workers, self.max_cores // self.cores_per_worker)


@dataclass(frozen=True)
class WorkerSample:
    """One worker at the end of an interval. The cost models are None unless fitted from
    the worker's own samples (the router's `is_fitted`): pooled fallbacks and priors
    would only echo themselves back into capacity."""

    worker_id: str
    role: Role
    warming: bool  # started recently: it counts as a member, never as measured capacity
    prefill: Quadratic | None  # seconds to prefill t tokens
    decode: Quadratic | None  # seconds of one decode step at n running sequences
    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    max_num_seqs: int = 256


@dataclass(frozen=True)
class Observation:
    """What the frontend measured over one interval ending at `now`."""

    now: float
    duration_s: float
    num_arrivals: int
    mean_prompt_tokens: float  # uncached part (after prefix hits); ignored with no arrivals
    mean_output_tokens: float
    ttft_attainment: float | None  # share of finished requests within the SLO; None: none
    tpot_attainment: float | None
    workers: tuple[WorkerSample, ...]
    # Start-to-serving time the cluster measured (load_time.py); None: the config's.
    model_load_s: float | None = None
    # The uncached prompt lengths' std / mean over the interval; None: not measured
    # (fewer than 2 arrivals), and the planner keeps what it had.
    prompt_cv: float | None = None


@dataclass(frozen=True)
class Step:
    """One change. For ADD, `worker_id` and `from_role` are None."""

    kind: StepKind
    role: Role | None  # the role added or switched to; None for REMOVE
    worker_id: str | None = None
    from_role: Role | None = None


@dataclass(frozen=True)
class Decision:
    """The target layout and counts, the steps to reach them in order (the budget holds
    after each), what the model predicts there, and why."""

    layout: Layout
    num_prefill: int  # 0 in the colocated layout
    num_decode: int  # Role.BOTH workers in the colocated layout
    steps: tuple[Step, ...]
    predicted_rate: float  # requests per second the target is sized for
    predicted_ttft_s: float  # at the attainment_target quantile, queueing included
    predicted_tpot_s: float
    reasons: tuple[str, ...] = field(default=())

    @property
    def is_change(self) -> bool:
        return bool(self.steps)
