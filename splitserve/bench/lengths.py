"""Token lengths: drawn from a LengthDist, scaled, and fitted to the server's context."""
from __future__ import annotations

import math

import numpy as np

from splitserve.bench.config import LengthDist


def sample_lengths(dist: LengthDist, n: int, rng: np.random.Generator) -> list[int]:
    """`n` draws of `dist` (see LengthDist), rounded, at least 1."""
    mean, spread = float(dist.mean), dist.spread
    if dist.kind == "fixed":
        values = np.full(n, mean)
    elif dist.kind == "uniform":
        values = rng.uniform(mean * (1 - spread), mean * (1 + spread), size=n)
    elif dist.kind == "normal":
        values = rng.normal(mean, spread * mean, size=n)
    else:  # lognormal: E[exp(N(mu, s^2))] = exp(mu + s^2/2) = mean
        values = rng.lognormal(math.log(mean) - spread ** 2 / 2, spread, size=n)
    return [max(1, int(round(v))) for v in values]


def scale_length(length: int, scale: float) -> int:
    """`length` * `scale`, rounded, at least 1 (the --length-scale of every workload)."""
    return max(1, int(round(length * scale)))


def fit_lengths(input_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """Cut (input, output) to what the server accepts: output < max_model_len and
    input + output <= max_model_len (the output is kept, the prompt shortened)."""
    if max_model_len is None:
        return input_len, output_len
    output_len = min(output_len, max_model_len - 1)
    return max(1, min(input_len, max_model_len - output_len)), output_len
