"""Load prediction: Holt's linear smoothing of the arrival rate with a damped trend
(Gardner and McKenzie: a step in load overshoots less), EWMAs of the prompt and output
lengths and of the prompt lengths' spread, and idle detection."""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

_NUM_ERRORS = 12  # interval-to-interval changes kept for the noise
_MIN_ERRORS = 3  # changes needed before the noise is measured rather than the prior
_MAD_TO_SIGMA = 1.4826  # median absolute deviation -> standard deviation (normal)


@dataclass(slots=True)
class LoadForecast:
    """Smoothed load; `observe` once per interval, then `rate_in(h)` for h intervals on."""

    alpha: float
    beta: float
    damping: float  # the trend's weight decays by this per interval ahead (Gardner)
    level: float = 0.0  # requests per second
    trend: float = 0.0  # change of the rate per interval
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    prompt_cv: float | None = None  # EWMA of the intervals' measured ones; None: none yet
    num_observed: int = 0
    num_idle: int = 0  # consecutive intervals with no arrivals and nothing in flight
    noise_prior: float = 0.2  # the noise assumed until _MIN_ERRORS are measured
    # |log| of the ratio of consecutive intervals' token rates (prompt tokens/s and output
    # tokens/s, whichever moved more), the last _NUM_ERRORS intervals with arrivals.
    changes: deque[float] = field(default_factory=lambda: deque(maxlen=_NUM_ERRORS))
    last_work: tuple[float, float] | None = None

    def observe(self, rate: float, num_arrivals: int, prompt_tokens: float,
                output_tokens: float, is_idle: bool, prompt_cv: float | None = None) -> None:
        self.num_idle = self.num_idle + 1 if is_idle else 0
        if num_arrivals > 0:
            self._track_change(rate * prompt_tokens, rate * output_tokens)
        if self.num_observed == 0:
            self.level = rate
        else:
            # Holt: the level follows the data; the trend follows the level's moves.
            previous = self.level
            damped = self.damping * self.trend
            self.level = self.alpha * rate + (1 - self.alpha) * (previous + damped)
            self.trend = self.beta * (self.level - previous) + (1 - self.beta) * damped
        self.num_observed += 1
        if num_arrivals > 0:
            # Lengths are weighted per interval, not per request: a quiet interval's few
            # requests move them as much as a busy one's (noisier, but never stale).
            first = self.prompt_tokens == 0 and self.output_tokens == 0
            weight = 1.0 if first else self.alpha
            self.prompt_tokens += weight * (prompt_tokens - self.prompt_tokens)
            self.output_tokens += weight * (output_tokens - self.output_tokens)
        if prompt_cv is not None:
            last = self.prompt_cv
            self.prompt_cv = prompt_cv if last is None else last + self.alpha * (prompt_cv - last)

    def _track_change(self, prefill_work: float, decode_work: float) -> None:
        last, self.last_work = self.last_work, (prefill_work, decode_work)
        if last is not None and min(*last, prefill_work, decode_work) > 0:
            self.changes.append(max(abs(math.log(prefill_work / last[0])),
                                    abs(math.log(decode_work / last[1]))))

    @property
    def noise(self) -> float:
        """Relative standard deviation of the load from one interval to the next: from the
        median of the changes between consecutive intervals, so a step in the load (one
        large change) is followed by the forecast, not kept as noise to add headroom for,
        and the smoothed lengths catching up after it count for nothing either."""
        if len(self.changes) < _MIN_ERRORS:
            return self.noise_prior
        # A difference of two independent samples has sqrt(2) times their deviation.
        return _MAD_TO_SIGMA * statistics.median(self.changes) / math.sqrt(2)

    def reset_rate(self) -> None:
        """Forget the rate (after an idle spell): the next load starts a fresh estimate
        instead of decaying from the old one."""
        self.level = self.trend = 0.0
        self.num_observed = 0

    def rate_in(self, intervals: float) -> float:
        """The rate forecast `intervals` ahead by the damped trend, never negative:
        level + trend * (phi + phi^2 + ... + phi^h)."""
        phi = self.damping
        weight = intervals if phi == 1 else phi * (1 - phi ** intervals) / (1 - phi)
        return max(0.0, self.level + weight * self.trend)
