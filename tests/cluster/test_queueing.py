"""planner/queueing.py: the collision counts of a colocated request (Poisson, and the
branching family of progeny_quantile) against their exact values and against sampling."""
from __future__ import annotations

import math

import numpy as np
import pytest

from splitserve.cluster.planner.queueing import poisson_quantile, progeny_quantile


def test_poisson_quantile() -> None:
    assert poisson_quantile(0.0, 0.9) == 0
    assert poisson_quantile(1.0, 0.9) == 2  # P(K <= 1) = 0.736, P(K <= 2) = 0.920
    assert poisson_quantile(0.1, 0.9) == 0  # P(K = 0) = 0.905
    assert poisson_quantile(0.2, 0.9) == 1
    assert poisson_quantile(30.0, 0.5) in (29, 30)
    # past exp()'s range (a large cluster's collisions): the normal approximation
    assert 1040 <= poisson_quantile(1000.0, 0.9) <= 1042
    assert poisson_quantile(100.0, 0.9) - 1 <= poisson_quantile(100.001, 0.9) <= (
        poisson_quantile(100.0, 0.9) + 1)  # the two methods meet


def _sampled_families(ancestors: float, offspring: float, n: int) -> np.ndarray:
    """Family sizes by simulation: each generation's children are Poisson(offspring x
    its size)."""
    rng = np.random.default_rng(11)
    size = rng.poisson(ancestors, n)
    total, generation = size.copy(), size
    while generation.any():
        generation = rng.poisson(offspring * generation)
        total += generation
    return total


@pytest.mark.parametrize("ancestors, offspring", [(0.5, 0.3), (0.7, 0.45), (2.0, 0.6),
                                                  (8.0, 0.5), (30.0, 0.5)])
def test_progeny_quantile_matches_sampled_families(ancestors: float, offspring: float) -> None:
    """(30, 0.5): a mean of 60, past the exact sum: the normal approximation."""
    sizes = _sampled_families(ancestors, offspring, 200_000)
    k = progeny_quantile(ancestors, offspring, 0.9)
    assert np.mean(sizes <= k) >= 0.9 - 0.005
    if k > 0:
        assert np.mean(sizes <= k - 1) < 0.9 + (0.005 if k < 64 else 0.02)


def test_progeny_quantile_edges() -> None:
    assert progeny_quantile(0.0, 0.5, 0.9) == 0  # no first member, no family
    assert progeny_quantile(1.0, 0.0, 0.9) == poisson_quantile(1.0, 0.9)  # no children
    assert progeny_quantile(1.0, 1.0, 0.9) == math.inf  # it never stops growing
    assert progeny_quantile(math.inf, 0.2, 0.9) == math.inf
    # more members or more children per member: never a smaller family
    ladder = [progeny_quantile(a, r, 0.9) for a, r in zip(np.linspace(0.1, 40, 60),
                                                          np.linspace(0.05, 0.9, 60))]
    assert ladder == sorted(ladder)
