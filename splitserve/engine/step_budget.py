"""A step's token budget by time (Sarathi-Serve's budget, measured instead of configured).

`max_num_batched_tokens` caps a step by tokens; how long those tokens take depends on the
machine (a 512-token chunk is ~0.4 s on an AVX-512 Zen 4 and ~5 s on one thread of an AVX2
Zen 1). With `max_step_ms` the scheduler also caps it by time: the engine reports each
step's tokens and seconds, `StepBudget` fits step time ~ base + tokens x per-token cost over
recent steps (least squares, older steps weighing less), and a step takes the tokens that
fit the target. Every running decode keeps its token whatever the fit says, and prompts
still get a few: a slow step never stalls a prefill. Chunk boundaries never change results
(the exact kernels are batch-invariant), so the budget moves only latency.
"""
from __future__ import annotations

import math

# Prompt tokens a step takes at least (beside its decodes), whatever the fit says.
MIN_PREFILL_TOKENS = 16
DECAY = 0.9  # weight of a step `k` steps old: DECAY ** k


class StepBudget:
    def __init__(self, max_step_s: float, max_tokens: int) -> None:
        if not (math.isfinite(max_step_s) and max_step_s > 0):
            raise ValueError(f"max_step_s={max_step_s} must be a positive number of seconds")
        self.max_step_s = max_step_s
        self.max_tokens = max_tokens
        # Decayed sums over observed steps: weight, tokens, seconds, tokens^2, tokens*seconds.
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One finished step: the tokens it computed and its wall time."""
        if num_tokens <= 0 or not (math.isfinite(seconds) and seconds >= 0):
            return
        d, x, y = DECAY, float(num_tokens), seconds
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y

    def cost(self) -> tuple[float, float] | None:
        """(base seconds, seconds per token) of a step, or None before any step. Steps all
        of one size cannot separate the two: their time per token stands for the per-token
        cost then (an overestimate: the budget errs short)."""
        if self._w == 0.0:
            return None
        spread = self._w * self._xx - self._x * self._x
        if spread > 1e-9 * self._w * self._xx:
            per_token = (self._w * self._xy - self._x * self._y) / spread
            base = (self._y - per_token * self._x) / self._w
            if per_token > 0 and base >= 0:
                return base, per_token
        return 0.0, self._y / self._x

    def tokens(self, num_decodes: int) -> int:
        """This step's token budget with `num_decodes` running decodes."""
        cost = self.cost()
        if cost is None:
            return self.max_tokens
        base, per_token = cost
        fit = math.floor((self.max_step_s - base) / per_token)
        return min(self.max_tokens, max(fit, num_decodes + MIN_PREFILL_TOKENS))
