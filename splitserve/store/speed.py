"""When a block below the pool is worth loading: the load-time model the worker and the
router share (DESIGN.md 5: "takes a lower tier only when loading is predicted faster
than recomputing those tokens").

Loading one block from a tier costs `latency_s + block_bytes / bytes_per_s`, measured
(an exponential average over loads) after a prior. Recomputing it costs what the engine's
prefill spends on `block_size` tokens. A prefix is loaded block by block from the pool's
end, so the rule is per block: load while the block's tier is faster than recomputing
it, stop at the first that is not (the rest is recomputed; a cheaper block further on
cannot be used without the ones before it).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .block import TierName

EWMA_WEIGHT = 0.2  # of each new measurement


@dataclass(slots=True)
class TierSpeed:
    latency_s: float  # per block: a lookup, a file open, a decrypt's setup
    bytes_per_s: float

    def block_s(self, block_bytes: int) -> float:
        return self.latency_s + block_bytes / self.bytes_per_s


# Before anything was measured: host memory copies at a few GB/s; the disk tier reads a
# file and decrypts it (AES-GCM ~2-4 GB/s on one core), so ~1 GB/s with a latency.
PRIORS = {TierName.HOST: TierSpeed(20e-6, 5e9), TierName.DISK: TierSpeed(200e-6, 1e9)}


class TierSpeeds:
    """Measured load speed of each tier (one worker's)."""

    def __init__(self) -> None:
        self._block_s: dict[TierName, float] = {}
        self.overrides: dict[TierName, TierSpeed] = {}  # tests; an operator's known speed

    def observe(self, tier: TierName, num_blocks: int, seconds: float) -> None:
        """`num_blocks` blocks took `seconds` to load from `tier`."""
        if num_blocks <= 0 or seconds < 0:
            return
        sample = seconds / num_blocks
        old = self._block_s.get(tier)
        self._block_s[tier] = sample if old is None else old + EWMA_WEIGHT * (sample - old)

    def block_s(self, tier: TierName, block_bytes: int) -> float:
        """Seconds to load one block of `block_bytes` from `tier`."""
        if tier in self.overrides:
            return self.overrides[tier].block_s(block_bytes)
        measured = self._block_s.get(tier)
        return measured if measured is not None else PRIORS[tier].block_s(block_bytes)


def blocks_worth_loading(tiers: Sequence[TierName], speeds: TierSpeeds, block_bytes: int,
                         recompute_block_s: float | None) -> int:
    """How many leading blocks (held in `tiers`, one tier per block) to load rather than
    recompute. `recompute_block_s` None (no prefill measured yet): load them all."""
    if recompute_block_s is None:
        return len(tiers)
    for i, tier in enumerate(tiers):
        if speeds.block_s(tier, block_bytes) >= recompute_block_s:
            return i
    return len(tiers)
