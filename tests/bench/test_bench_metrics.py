"""The metric math against hand-computed examples (vLLM's benchmark definitions)."""
from __future__ import annotations

import pytest

from splitserve.bench.config import SLO
from splitserve.bench.metrics import Stats, compute_metrics
from splitserve.bench.record import RequestRecord


def rec(index: int, send: float, chunks: list[float], tokens: int | None = None,
        error: str | None = None, status: int | None = 200) -> RequestRecord:
    r = RequestRecord(index, prompt_len=10, intended_output_len=tokens or len(chunks),
                      scheduled_s=send, send_s=send, chunk_s=list(chunks),
                      end_s=(chunks[-1] if chunks else send) + 0.01,
                      output_tokens=tokens if tokens is not None else len(chunks),
                      status=status, error=error)
    return r


# A: slow first token; B: fast; C: one output token (no TPOT); D: failed (HTTP 500).
A = rec(0, 0.0, [1.0, 1.5, 2.5])
B = rec(1, 1.0, [1.2, 1.3, 1.4, 1.5, 1.6])
C = rec(2, 2.0, [2.1])
D = rec(3, 3.0, [], tokens=0, error="server error", status=500)


def test_per_request_latencies() -> None:
    assert A.ttft_s == pytest.approx(1.0)
    assert A.e2e_s == pytest.approx(2.5)
    assert A.tpot_s == pytest.approx((2.5 - 1.0) / 2)
    assert A.itl_s == pytest.approx([0.5, 1.0])
    assert B.tpot_s == pytest.approx(0.1)
    assert C.tpot_s is None and C.itl_s == [] and C.ttft_s == pytest.approx(0.1)
    assert not D.is_completed and D.ttft_s is None and D.tpot_s is None and D.itl_s == []


def test_tpot_excludes_the_first_token() -> None:
    r = rec(0, 0.0, [10.0, 10.1, 10.2])  # a 10 s prefill, then 100 ms per token
    assert r.tpot_s == pytest.approx(0.1)
    assert r.e2e_s is not None
    assert r.e2e_s / 3 == pytest.approx(3.4)  # the naive E2E / tokens would be 34x off


def test_tpot_counts_usage_tokens_not_chunks() -> None:
    r = rec(0, 0.0, [1.0, 1.2, 1.4], tokens=5)  # 5 tokens arrived in 3 chunks
    assert r.tpot_s == pytest.approx(0.4 / 4)
    assert r.itl_s == pytest.approx([0.2, 0.2])  # ITL stays per chunk


def test_percentiles_interpolate_linearly() -> None:
    s = Stats.of_seconds([0.004, 0.001, 0.003, 0.002])
    assert (s.count, s.mean, s.median) == (4, pytest.approx(2.5), pytest.approx(2.5))
    assert s.p90 == pytest.approx(1 + 0.9 * 3)  # rank 2.7 of 0..3 -> 3.7 ms
    assert s.p99 == pytest.approx(3.97)
    assert Stats.of_seconds([]) == Stats(0, None, None, None, None)


def test_run_summary_by_hand() -> None:
    m = compute_metrics([A, B, C, D], duration_s=4.0, slo=SLO(ttft_ms=500, tpot_ms=800))
    assert (m.num_sent, m.num_completed, m.num_failed) == (4, 3, 1)
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx((3 + 5 + 1) / 4)
    assert m.total_token_throughput == pytest.approx((9 + 30) / 4)
    assert m.ttft_ms.mean == pytest.approx((1000 + 200 + 100) / 3)
    assert m.ttft_ms.median == pytest.approx(200)
    assert m.ttft_ms.p90 == pytest.approx(200 + 0.8 * 800)
    assert m.tpot_ms.count == 2 and m.tpot_ms.mean == pytest.approx((750 + 100) / 2)
    assert m.e2e_ms.mean == pytest.approx((2500 + 600 + 100) / 3)
    assert m.errors == {"500: server error": 1}


def test_itl_pools_gaps_over_requests() -> None:
    m = compute_metrics([A, B, C, D], duration_s=4.0, slo=SLO())
    # 2 gaps of A (500, 1000 ms) and 4 of B (100 ms each), one pool of 6:
    assert m.itl_ms.count == 6
    assert m.itl_ms.mean == pytest.approx(1900 / 6)  # not the mean of per-request means
    assert m.itl_ms.median == pytest.approx(100)


def test_goodput_counts_only_requests_meeting_every_slo() -> None:
    m = compute_metrics([A, B, C, D], duration_s=4.0, slo=SLO(ttft_ms=500, tpot_ms=800))
    # A misses TTFT (1000 > 500) though its TPOT (750) is fine; B meets both; C has no
    # TPOT, so it meets the TPOT target; D failed.
    assert m.num_met_slo == 2
    assert m.goodput == pytest.approx(2 / 4.0)
    assert m.ttft_attainment == pytest.approx(2 / 4)
    assert m.tpot_attainment == pytest.approx(3 / 4)
    strict = compute_metrics([A, B, C, D], 4.0, SLO(ttft_ms=500, tpot_ms=50))
    assert strict.num_met_slo == 1  # only C: B's TPOT 100 ms > 50


def test_attainment_denominator_is_sent_requests() -> None:
    m = compute_metrics([B, D], duration_s=2.0, slo=SLO(ttft_ms=1000))
    assert m.slo_attainment == pytest.approx(0.5)  # D failed: it counts as missing
    none_given = compute_metrics([B, C, D], duration_s=2.0, slo=SLO())
    assert none_given.slo_attainment == pytest.approx(2 / 3)


def test_short_outputs_are_counted() -> None:
    short = rec(5, 0.0, [0.1, 0.2], tokens=2)
    short.intended_output_len = 8
    m = compute_metrics([short, B], 1.0, SLO())
    assert (m.num_short_outputs, m.output_tokens, m.intended_output_tokens) == (1, 7, 13)
