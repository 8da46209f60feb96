"""A run's summary metrics from its RequestRecords, with vLLM's benchmark definitions.

- TTFT, E2E: per completed request (see RequestRecord).
- TPOT: per completed request with >= 2 output tokens, (E2E - TTFT) / (output tokens - 1).
- ITL: every gap between consecutive output chunks, pooled over all completed requests
  (so a long request weighs more than a short one, unlike TPOT's per-request mean).
- Percentiles: numpy's linear interpolation; mean, median, p90, p99, in milliseconds.
- Throughput: completed requests (or their output tokens) / duration, where duration is
  the run's start (the first scheduled arrival) -> the last request's end.
- SLO attainment: requests that completed and met every given SLO / requests sent (a failed
  request counts as missing the SLO). Goodput: those requests / duration.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.bench.config import SLO
from splitserve.bench.record import RequestRecord


@dataclass(frozen=True)
class Stats:
    """Distribution of one latency, in milliseconds (None when there are no values)."""
    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Stats:
        if not values:
            return cls(0, None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(x) for x in np.percentile(ms, [50, 90, 99]))
        return cls(len(values), float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class RunMetrics:
    """The summary of one run (see the module docstring for every definition)."""
    num_sent: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    total_token_throughput: float  # (prompt + output) tokens of completed requests / s
    intended_output_tokens: int  # sum of max_tokens over completed requests
    output_tokens: int  # sum of actual output tokens over completed requests
    num_short_outputs: int  # completed requests with fewer output tokens than intended
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo: SLO
    num_met_slo: int
    slo_attainment: float  # num_met_slo / num_sent
    ttft_attainment: float  # met the TTFT target alone / num_sent
    tpot_attainment: float  # met the TPOT target alone / num_sent
    goodput: float  # num_met_slo / duration_s
    errors: dict[str, int]  # error message (first 120 characters) -> count


def compute_metrics(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> RunMetrics:
    """The summary of a run of `records` that lasted `duration_s` seconds."""
    done = [r for r in records if r.is_completed]
    sent = len(records)
    out_tokens = sum(r.output_tokens or 0 for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    met = sum(r.meets(slo) for r in records)
    met_ttft = sum(r.meets(SLO(ttft_ms=slo.ttft_ms)) for r in records)
    met_tpot = sum(r.meets(SLO(tpot_ms=slo.tpot_ms)) for r in records)
    errors: dict[str, int] = {}
    for r in records:
        if not r.is_completed:
            key = f"{r.status or '-'}: {(r.error or 'no output')[:120]}"
            errors[key] = errors.get(key, 0) + 1
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    return RunMetrics(
        num_sent=sent, num_completed=len(done), num_failed=sent - len(done),
        duration_s=duration_s, request_throughput=len(done) * per_s,
        output_throughput=out_tokens * per_s,
        total_token_throughput=(out_tokens + prompt_tokens) * per_s,
        intended_output_tokens=sum(r.intended_output_len for r in done),
        output_tokens=out_tokens,
        num_short_outputs=sum((r.output_tokens or 0) < r.intended_output_len for r in done),
        ttft_ms=Stats.of_seconds([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=Stats.of_seconds([r.tpot_s for r in done if r.tpot_s is not None]),
        itl_ms=Stats.of_seconds([gap for r in done for gap in r.itl_s]),
        e2e_ms=Stats.of_seconds([r.e2e_s for r in done if r.e2e_s is not None]),
        slo=slo, num_met_slo=met,
        slo_attainment=met / sent if sent else 0.0,
        ttft_attainment=met_ttft / sent if sent else 0.0,
        tpot_attainment=met_tpot / sent if sent else 0.0,
        goodput=met * per_s, errors=errors)
