"""BenchConfig: everything one `splitserve bench` run is a function of (frozen, JSON-able)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

WORKLOADS = ("synthetic", "sessions", "mooncake", "azure")
DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution with the given mean.

    `spread` shapes it: uniform on [mean*(1-spread), mean*(1+spread)]; normal with standard
    deviation spread*mean; lognormal with sigma = spread for log(length), mu chosen so the
    mean stays `mean`. Draws are rounded and at least 1; `fixed` ignores `spread`.
    """
    kind: str = "fixed"
    mean: int = 128
    spread: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ValueError(f"length distribution {self.kind!r} unknown; use one of "
                             f"{', '.join(DISTRIBUTIONS)}")
        if self.mean < 1:
            raise ValueError(f"mean length {self.mean} must be >= 1 token")
        if self.spread < 0 or (self.kind == "uniform" and self.spread > 1):
            raise ValueError(f"spread {self.spread} out of range (uniform: 0..1, others >= 0)")


@dataclass(frozen=True)
class SLO:
    """Latency targets; None = no target on that metric. A request meets the SLO when it
    completed and meets every given target (see `RequestRecord.meets`)."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None


@dataclass(frozen=True)
class BenchConfig:
    """One bench run against an OpenAI-compatible server.

    `rate` is requests/s: None = the workload's natural arrivals (trace timestamps, or all
    at once for synthetic and sessions); math.inf = all at once; a trace workload with a
    finite rate has its timestamps rescaled to that mean rate; other workloads draw gamma
    intervals with shape `burstiness` (1 = Poisson). `run_index` salts the prompt tokens so
    runs of one sweep never hit each other's prefix cache.
    """
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first of /v1/models
    endpoint: str = "completions"
    workload: str = "synthetic"
    num_requests: int = 100
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 256))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64))
    turns: int = 4  # sessions: turns per session
    system_len: int = 256  # sessions: shared system prompt tokens
    trace: str | None = None  # trace workloads: path (None: ../shared/data/traces/<file>)
    trace_jitter_s: float | None = None  # None: the format's timestamp granularity
    rate: float | None = None
    burstiness: float = 1.0
    length_scale: float = 1.0
    time_scale: float | None = None  # trace workloads: multiply inter-arrival times
    slo: SLO = field(default_factory=SLO)
    seed: int = 0
    run_index: int = 0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    max_model_len: int | None = None  # None: the server's (from /v1/models)
    token_low: int = 1000  # prompt token ids are drawn from [token_low, token_high)
    token_high: int = 40000
    temperature: float = 0.0
    label: str = "bench"
    show_progress: bool = False

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload {self.workload!r} unknown; use one of "
                             f"{', '.join(WORKLOADS)}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r} unknown; use one of "
                             f"{', '.join(ENDPOINTS)}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests {self.num_requests} must be >= 1")
        if self.rate is not None and not (self.rate > 0):
            raise ValueError(f"--rate {self.rate} must be > 0 (or inf: all at once)")
        if not (self.burstiness > 0):
            raise ValueError(f"--burstiness {self.burstiness} must be > 0 (1 = Poisson)")
        replays_trace = self.is_trace and (self.rate is None or math.isfinite(self.rate))
        if self.burstiness != 1.0 and replays_trace:
            raise ValueError("--burstiness applies to generated arrivals; a trace replays its "
                             "own timestamps")
        if not (self.length_scale > 0):
            raise ValueError(f"--length-scale {self.length_scale} must be > 0")
        if self.time_scale is not None:
            if not self.is_trace:
                raise ValueError("--time-scale applies to trace workloads; use --rate otherwise")
            if self.rate is not None:
                raise ValueError("give --rate or --time-scale, not both")
            if not (self.time_scale > 0):
                raise ValueError(f"--time-scale {self.time_scale} must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency {self.max_concurrency} must be >= 1")
        if self.turns < 1 or self.system_len < 0:
            raise ValueError("--turns must be >= 1 and --system-len >= 0")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"token id range [{self.token_low}, {self.token_high}) is empty")
        if not self.label or "/" in self.label:
            raise ValueError(f"--label {self.label!r} must be a non-empty file name")

    @property
    def is_trace(self) -> bool:
        return self.workload in ("mooncake", "azure")
