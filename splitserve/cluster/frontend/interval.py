"""What the planner reads every interval from the request path: arrivals, the prompt
tokens they bring (minus the prefix the router expected cached) and their spread, the
output tokens of those that finished, and how many met the TTFT and TPOT targets. `take`
returns the interval's totals and starts the next one."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class IntervalTotals:
    duration_s: float
    num_arrivals: int
    num_prompt_tokens: int  # uncached, as routed
    sum_prompt_squares: int  # of each arrival's uncached prompt tokens: their spread
    num_finished: int  # ended well (stop or length) with a token
    num_output_tokens: int  # of those
    num_ttft_met: int
    num_tpot_met: int

    @property
    def mean_prompt_tokens(self) -> float:
        return self.num_prompt_tokens / self.num_arrivals if self.num_arrivals else 0.0

    @property
    def prompt_cv(self) -> float | None:
        """The uncached prompt lengths' coefficient of variation (std / mean); None with
        fewer than 2 arrivals or no prompt tokens."""
        if self.num_arrivals < 2 or self.num_prompt_tokens <= 0:
            return None
        mean = self.mean_prompt_tokens
        variance = self.sum_prompt_squares / self.num_arrivals - mean * mean
        return math.sqrt(max(variance, 0.0)) / mean

    @property
    def mean_output_tokens(self) -> float:
        return self.num_output_tokens / self.num_finished if self.num_finished else 0.0

    @property
    def ttft_attainment(self) -> float | None:
        return self.num_ttft_met / self.num_finished if self.num_finished else None

    @property
    def tpot_attainment(self) -> float | None:
        return self.num_tpot_met / self.num_finished if self.num_finished else None


class IntervalStats:
    def __init__(self, now: float, slo_ttft_s: float | None, slo_tpot_s: float | None) -> None:
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self._start = now
        self._arrivals = self._prompt = self._prompt_squares = self._finished = self._output = 0
        self._ttft_met = self._tpot_met = 0

    def routed(self, num_uncached_tokens: int) -> None:
        """A new request was placed (its first attempt)."""
        self._arrivals += 1
        self._prompt += max(0, num_uncached_tokens)
        self._prompt_squares += max(0, num_uncached_tokens) ** 2

    def finished(self, ttft_s: float, tpot_s: float, num_output_tokens: int) -> None:
        self._finished += 1
        self._output += num_output_tokens
        self._ttft_met += self.slo_ttft_s is None or ttft_s <= self.slo_ttft_s
        self._tpot_met += self.slo_tpot_s is None or tpot_s <= self.slo_tpot_s

    def take(self, now: float) -> IntervalTotals:
        totals = IntervalTotals(now - self._start, self._arrivals, self._prompt,
                                self._prompt_squares, self._finished, self._output,
                                self._ttft_met, self._tpot_met)
        self.__init__(now, self.slo_ttft_s, self.slo_tpot_s)  # type: ignore[misc]
        return totals
