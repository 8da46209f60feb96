"""Synthetic and sessions workloads: length distributions, scaling, fitting, exact
prefix reuse between a session's turns."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from splitserve.bench.config import BenchConfig, LengthDist
from splitserve.bench.lengths import fit_lengths, sample_lengths
from splitserve.bench.workload import build_workload, prefix_reuse_ratio


def test_fixed_lengths() -> None:
    assert sample_lengths(LengthDist("fixed", 37), 5, np.random.default_rng(0)) == [37] * 5


@pytest.mark.parametrize("kind,spread", [("uniform", 0.5), ("normal", 0.2), ("lognormal", 0.5)])
def test_distributions_keep_their_mean(kind: str, spread: float) -> None:
    draws = np.array(sample_lengths(LengthDist(kind, 200, spread), 20000,
                                    np.random.default_rng(0)))
    assert draws.mean() == pytest.approx(200, rel=0.02)
    assert draws.min() >= 1
    if kind == "uniform":
        assert draws.min() >= 100 and draws.max() <= 300
    if kind == "normal":
        assert draws.std() == pytest.approx(40, rel=0.05)
    if kind == "lognormal":
        assert np.log(draws).std() == pytest.approx(0.5, rel=0.05)


def test_bad_distribution_names_what_exists() -> None:
    with pytest.raises(ValueError, match="fixed, uniform, normal, lognormal"):
        LengthDist("zipf", 10)


def test_fit_lengths_to_the_context() -> None:
    assert fit_lengths(3000, 100, 2048) == (1948, 100)
    assert fit_lengths(10, 5000, 2048) == (1, 2047)
    assert fit_lengths(3000, 100, None) == (3000, 100)


def test_synthetic_workload_lengths_and_tokens() -> None:
    cfg = BenchConfig(num_requests=6, input_len=LengthDist("uniform", 40, 0.5),
                      output_len=LengthDist("fixed", 8), token_low=1000, token_high=2000)
    wl = build_workload(cfg, None)
    assert len(wl.requests) == 6 and all(r.output_len == 8 for r in wl.requests)
    assert all(20 <= len(r.prompt_token_ids) <= 60 for r in wl.requests)
    assert all(1000 <= t < 2000 for r in wl.requests for t in r.prompt_token_ids)
    again = build_workload(cfg, None)
    assert [r.prompt_token_ids for r in again.requests] == [r.prompt_token_ids for r in wl.requests]
    salted = build_workload(dataclasses.replace(cfg, run_index=1), None)
    assert [len(r.prompt_token_ids) for r in salted.requests] == [
        len(r.prompt_token_ids) for r in wl.requests]  # same lengths,
    assert salted.requests[0].prompt_token_ids != wl.requests[0].prompt_token_ids  # new tokens


def test_length_scale_and_clamping() -> None:
    cfg = BenchConfig(num_requests=3, input_len=LengthDist("fixed", 1000),
                      output_len=LengthDist("fixed", 100), length_scale=0.5)
    wl = build_workload(cfg, None)
    assert [(len(r.prompt_token_ids), r.output_len) for r in wl.requests] == [(500, 50)] * 3
    clamped = build_workload(BenchConfig(num_requests=3, input_len=LengthDist("fixed", 1000),
                                         output_len=LengthDist("fixed", 100), length_scale=3.0),
                             2048)
    assert [(len(r.prompt_token_ids), r.output_len) for r in clamped.requests] == [(1748, 300)] * 3
    assert clamped.info.num_clamped == 3 and "scaled x3" in clamped.info.description


def test_prefix_reuse_ratio_by_hand() -> None:
    a, b = list(range(32)), list(range(100, 116))
    assert prefix_reuse_ratio([a, a + b], block_size=16) == pytest.approx(32 / 80)
    assert prefix_reuse_ratio([a, b + a], block_size=16) == 0.0  # not a prefix: no reuse


def _sessions(n: int = 12, limit: int | None = None, **kw: object) -> BenchConfig:
    return BenchConfig(workload="sessions", num_requests=n, turns=4, system_len=32,
                       input_len=LengthDist("fixed", 20), output_len=LengthDist("fixed", 6),
                       **kw)  # type: ignore[arg-type]


def test_sessions_reuse_earlier_turns_exactly() -> None:
    wl = build_workload(_sessions(), None)
    reqs = wl.requests
    assert wl.info.num_sessions == 3 and len(reqs) == 12
    # turn-major order: turn 0 of sessions 0..2, then turn 1 of each, ...
    assert [r.session_id for r in reqs] == [0, 1, 2] * 4
    system = reqs[0].prompt_token_ids[:32]
    for i, r in enumerate(reqs):
        assert r.prompt_token_ids[:32] == system  # one shared system prompt
        if r.after is None:
            assert i < 3 and len(r.prompt_token_ids) == 32 + 20
            continue
        prev = reqs[r.after]
        assert prev.session_id == r.session_id and r.after < i
        # this turn = the previous prompt, its reply (output_len tokens), a new user turn
        assert r.prompt_token_ids[:len(prev.prompt_token_ids)] == prev.prompt_token_ids
        assert len(r.prompt_token_ids) == len(prev.prompt_token_ids) + 6 + 20
    # sessions differ right after the system prompt
    assert reqs[0].prompt_token_ids[32:] != reqs[1].prompt_token_ids[32:]
    assert wl.info.prefix_reuse_ratio > 0.5


def test_sessions_end_at_the_context_limit() -> None:
    wl = build_workload(_sessions(n=8), 120)  # turns: 52+6, 78+6, 104+6, 130+6 > 120
    assert len(wl.requests) == 6 and wl.info.num_dropped == 2
    assert all(len(r.prompt_token_ids) + r.output_len <= 120 for r in wl.requests)
