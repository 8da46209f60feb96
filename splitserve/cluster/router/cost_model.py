"""Predicted seconds for the router's costs (DESIGN.md 5): prefill time of t uncached
tokens and decode step time at n running sequences. (KV transfer time is latency + bytes /
bandwidth from the config, in scoring.py.)

Prefill is fitted as `a + b*t + c*t^2` (attention makes long prompts super-linear) by
least squares over a sliding window of observed (tokens, seconds) samples. A fit is only
used when it is non-decreasing in t (b >= 0 and c >= 0 on t >= 0); otherwise the linear
fit `a + b*t` is tried, and failing that the model answers with its fallback (the pooled
model of all workers) or the configured prior. Predictions are clamped at 0. Fits run
when samples arrive (every sample while warming up, then every `refit_every`), never
while predicting, so the router's hot path only evaluates a polynomial.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

# Fits whose scaled design matrix is worse conditioned than this are not trusted.
_MAX_CONDITION = 1e8


@dataclass(frozen=True)
class CostModelConfig:
    """Priors used before enough samples are seen, and the fitting window."""

    # Prefill prior: fixed + per-token (+ per token squared: attention) seconds (1500
    # tokens/s, 5 ms per step). `--mode auto` gives the curves it measured on this machine
    # (auto_layout.router_costs).
    prefill_fixed_s: float = 0.005
    prefill_per_token_s: float = 1.0 / 1500
    prefill_per_token2_s: float = 0.0
    # Decode step prior: base + per running sequence seconds.
    decode_step_base_s: float = 0.02
    decode_step_per_seq_s: float = 0.004
    # Samples kept per model (the most recent ones).
    window: int = 256
    # Samples needed before a fit replaces the prior or the fallback.
    min_samples: int = 8
    # Once 2 * min_samples are in, refit after this many new samples (a fit is ~50 us).
    refit_every: int = 8

    def __post_init__(self) -> None:
        if self.refit_every < 1:
            raise ValueError(f"refit_every={self.refit_every} must be >= 1")
        if self.window < 3 or self.min_samples < 3 or self.min_samples > self.window:
            raise ValueError(f"need 3 <= min_samples ({self.min_samples}) <= window "
                             f"({self.window}) to fit three coefficients")
        if min(self.prefill_fixed_s, self.prefill_per_token_s, self.prefill_per_token2_s,
               self.decode_step_base_s, self.decode_step_per_seq_s) < 0:
            raise ValueError("cost model priors must be non-negative seconds")


class Quadratic(NamedTuple):
    """Seconds = a + b*x + c*x^2."""

    a: float
    b: float
    c: float

    def __call__(self, x: float) -> float:
        return max(0.0, self.a + x * (self.b + x * self.c))


def _lstsq(x: np.ndarray, y: np.ndarray, degree: int) -> Quadratic | None:
    """Least-squares polynomial of `degree` (1 or 2) in x, or None when ill-conditioned,
    or decreasing somewhere on x >= 0 (flat is a fit)."""
    scale = float(x.max())
    xs = x / scale  # columns of comparable size keep the normal equations well conditioned
    design = np.stack([xs ** k for k in range(degree + 1)], axis=1)
    coef, _, rank, singular = np.linalg.lstsq(design, y, rcond=None)
    if rank < degree + 1 or singular[0] > _MAX_CONDITION * singular[-1]:
        return None
    # A term worth under a billionth of the largest time at the largest x is rounding:
    # flat data (a decode step bound by reading the weights) fits b = 0, not b = -1e-19.
    tiny = 1e-9 * float(np.abs(y).max())
    b_xs, c_xs = (float(v) if abs(v) > tiny else 0.0 for v in
                  (coef[1], coef[2] if degree == 2 else 0.0))
    if b_xs < 0 or c_xs < 0:
        return None
    return Quadratic(float(coef[0]), b_xs / scale, c_xs / scale ** 2)


class _Samples:
    """A bounded window of (x, seconds) samples and the fit over them (None: none yet,
    or none trusted)."""

    def __init__(self, config: CostModelConfig, max_degree: int) -> None:
        self.config = config
        self.max_degree = max_degree
        self.samples: deque[tuple[float, float]] = deque(maxlen=config.window)
        self.fit: Quadratic | None = None
        self.num_new = 0  # samples since the last fit

    def add(self, x: int, seconds: float) -> bool:
        """Record a sample; refits when due. Returns True when the fit changed."""
        if x <= 0 or not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"sample ({x}, {seconds}) needs a positive count and finite "
                             f"non-negative seconds")
        self.samples.append((float(x), seconds))
        self.num_new += 1
        # NOTE: fitted here, not on predict, so routing never pays for a fit.
        warming_up = len(self.samples) < 2 * self.config.min_samples
        if self.num_new < (1 if warming_up else self.config.refit_every):
            return False
        self.num_new = 0
        old, self.fit = self.fit, self._refit()
        return self.fit != old

    def _refit(self) -> Quadratic | None:
        if len(self.samples) < self.config.min_samples:
            return None
        data = np.array(self.samples)  # [num_samples, 2]
        x, y = data[:, 0], data[:, 1]
        # Not np.unique: its first call imports numpy.ma, 20-30 ms on a request's path.
        num_distinct = len(set(x.tolist()))
        for degree in range(min(self.max_degree, num_distinct - 1), 0, -1):
            fit = _lstsq(x, y, degree)
            if fit is not None:
                return fit
        return None


class _FittedCurve:
    """Seconds as a fitted polynomial of one count: own fit, else the fallback model's
    (e.g. pooled over workers), else the configured prior."""

    def __init__(self, config: CostModelConfig, max_degree: int, prior: Quadratic,
                 fallback: _FittedCurve | None) -> None:
        self._samples = _Samples(config, max_degree=max_degree)
        self._fallback = fallback
        self._prior = prior

    @property
    def num_samples(self) -> int:
        return len(self._samples.samples)

    @property
    def is_fitted(self) -> bool:
        """True when predictions come from this model's own samples."""
        return self._samples.fit is not None

    @property
    def coefficients(self) -> Quadratic:
        """The curve in use: own fit, else the fallback's, else the prior."""
        fit = self._samples.fit
        if fit is not None:
            return fit
        return self._fallback.coefficients if self._fallback is not None else self._prior

    def observe(self, x: int, seconds: float) -> bool:
        """Record one measurement; True when the fitted curve changed."""
        return self._samples.add(x, seconds)


class PrefillCostModel(_FittedCurve):
    """Seconds to prefill t uncached tokens on one worker (or pooled over workers):
    `a + b*t + c*t^2`."""

    def __init__(self, config: CostModelConfig,
                 fallback: PrefillCostModel | None = None) -> None:
        super().__init__(config, 2, Quadratic(config.prefill_fixed_s,
                                              config.prefill_per_token_s,
                                              config.prefill_per_token2_s), fallback)

    def predict(self, num_tokens: int) -> float:
        """Predicted seconds; 0 for no tokens, never negative, non-decreasing in t."""
        if num_tokens <= 0:
            return 0.0
        return self.coefficients(num_tokens)


class DecodeStepModel(_FittedCurve):
    """Seconds of one decode step with n running sequences: `a + b*n`, fitted like
    `PrefillCostModel` (linear only)."""

    def __init__(self, config: CostModelConfig, fallback: DecodeStepModel | None = None) -> None:
        super().__init__(config, 1, Quadratic(config.decode_step_base_s,
                                              config.decode_step_per_seq_s, 0.0), fallback)

    def predict(self, num_seqs: int) -> float:
        """Predicted seconds of one step; 0 with nothing running."""
        if num_seqs <= 0:
            return 0.0
        return self.coefficients(num_seqs)
