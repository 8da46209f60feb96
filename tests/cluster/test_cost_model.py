"""Cost models: priors, least-squares fits, fallbacks when a fit would decrease."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.cluster.router.cost_model import (CostModelConfig, DecodeStepModel,
                                                  PrefillCostModel, Quadratic)

CFG = CostModelConfig(prefill_fixed_s=0.005, prefill_per_token_s=0.001,
                      decode_step_base_s=0.02, decode_step_per_seq_s=0.004,
                      window=16, min_samples=4, refit_every=1)


def test_prior_before_enough_samples() -> None:
    model = PrefillCostModel(CFG)
    assert model.predict(0) == 0.0
    assert model.predict(1000) == pytest.approx(1.005)
    for t in (100, 200, 300):
        model.observe(t, 5.0)
    assert not model.is_fitted  # 3 < min_samples
    assert model.coefficients == Quadratic(0.005, 0.001, 0.0)


def test_quadratic_fit_recovers_exact_coefficients() -> None:
    model = PrefillCostModel(CFG)
    true = Quadratic(0.01, 0.002, 3e-6)
    for t in (16, 128, 512, 1024, 2048, 4096):
        model.observe(t, true(t))
    assert model.is_fitted
    a, b, c = model.coefficients
    assert (a, b, c) == pytest.approx((0.01, 0.002, 3e-6), rel=1e-6, abs=1e-9)
    assert model.predict(3000) == pytest.approx(0.01 + 6.0 + 27.0)


def test_concave_data_falls_back_to_linear() -> None:
    model = PrefillCostModel(CFG)
    # Saturating curve: a quadratic fit has c < 0 and would decrease for long prompts.
    for t in (100, 200, 400, 800, 1600):
        model.observe(t, 1.0 - (1.0 - t / 1600) ** 2)
    a, b, c = model.coefficients
    assert c == 0.0 and b > 0
    values = [model.predict(t) for t in range(0, 20000, 500)]
    assert values == sorted(values)


def test_decreasing_data_is_not_trusted() -> None:
    pooled = PrefillCostModel(CFG)
    model = PrefillCostModel(CFG, fallback=pooled)
    for t in (100, 200, 300, 400):
        model.observe(t, 1.0 / t)
    assert not model.is_fitted
    assert model.predict(1000) == pytest.approx(1.005)  # pooled model's prior
    for t in (100, 200, 300, 400):
        pooled.observe(t, 0.5 + 0.01 * t)
    assert model.predict(1000) == pytest.approx(10.5)  # now the pooled fit


def test_one_distinct_length_cannot_be_fitted() -> None:
    model = PrefillCostModel(CFG)
    for _ in range(8):
        model.observe(512, 0.3)
    assert not model.is_fitted
    assert model.predict(512) == pytest.approx(0.517)


def test_window_forgets_old_samples() -> None:
    model = PrefillCostModel(CFG)
    for t in range(1, 17):
        model.observe(100 * t, 10.0 * t)  # slow regime: 0.1 s per token
    for t in range(1, 17):
        model.observe(100 * t, 0.001 * 100 * t)  # after a change: 1 ms per token
    assert model.num_samples == 16
    assert model.coefficients == pytest.approx((0.0, 0.001, 0.0), abs=1e-9)


def test_negative_intercept_clamps_at_zero() -> None:
    model = PrefillCostModel(CFG)
    for t in (100, 200, 300, 400):
        model.observe(t, 0.001 * t - 0.05)
    assert model.predict(10) == 0.0
    assert model.predict(100) == pytest.approx(0.05)


def test_decode_step_model() -> None:
    model = DecodeStepModel(CFG)
    assert model.predict(0) == 0.0
    assert model.predict(10) == pytest.approx(0.06)
    for n in (1, 2, 4, 8, 16):
        model.observe(n, 0.03 + 0.002 * n)
    assert model.coefficients == pytest.approx((0.03, 0.002, 0.0))
    assert model.predict(32) == pytest.approx(0.094)


def test_bad_samples_and_config_raise() -> None:
    model = PrefillCostModel(CFG)
    with pytest.raises(ValueError, match="positive count"):
        model.observe(0, 1.0)
    with pytest.raises(ValueError, match="non-negative"):
        model.observe(10, float("nan"))
    with pytest.raises(ValueError, match="min_samples"):
        CostModelConfig(window=4, min_samples=8)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8192), st.floats(0, 100)), min_size=4, max_size=40))
def test_predictions_never_negative_or_decreasing(samples: list[tuple[int, float]]) -> None:
    model = PrefillCostModel(CFG)
    for t, s in samples:
        model.observe(t, s)
    values = [model.predict(t) for t in range(0, 16384, 97)]
    assert all(v >= 0 for v in values)
    assert all(later >= earlier for earlier, later in zip(values, values[1:]))


def test_refits_every_sample_while_warming_up_then_every_refit_every() -> None:
    model = PrefillCostModel(CostModelConfig(window=64, min_samples=4, refit_every=8))
    line = Quadratic(0.0, 0.001, 0.0)
    changed = [model.observe(100 * t, line(100 * t)) for t in range(1, 8)]
    assert changed[:4] == [False, False, False, True] and model.is_fitted
    before = model.coefficients
    steeper = Quadratic(0.0, 0.01, 0.0)
    changed = [model.observe(100 * t, steeper(100 * t)) for t in range(1, 9)]
    assert changed == [False] * 7 + [True]  # one refit once 8 new samples are in
    assert model.coefficients != before and model.predict(800) > 2 * line(800)
