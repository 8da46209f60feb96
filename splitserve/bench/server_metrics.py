"""The server's own view of a run: its Prometheus `/metrics` scraped before and after,
histogram sums/counts and counters differenced. Only `splitserve_*` metrics are read; a
server without them (vLLM, ...) gets no breakdown."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

PREFIX = "splitserve_"
SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)

# The per-phase rows of the markdown breakdown: (row title, histogram, labels).
PHASES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("queue: admission", "splitserve_queue_time_seconds", {"phase": "admission"}),
    ("queue: prefill (dispatch -> first token)", "splitserve_queue_time_seconds",
     {"phase": "prefill"}),
    ("queue: kv (decode worker awaiting KV)", "splitserve_queue_time_seconds", {"phase": "kv"}),
    ("TTFT (server)", "splitserve_time_to_first_token_seconds", {}),
    ("TPOT (server, decode)", "splitserve_time_per_output_token_seconds", {}),
    ("E2E (server)", "splitserve_e2e_request_latency_seconds", {}),
    ("KV transfer: total", "splitserve_kv_transfer_seconds", {"stage": "total"}),
    ("KV transfer: exposed (not overlapped)", "splitserve_kv_transfer_seconds",
     {"stage": "exposed"}),
    ("KV transfer: wire", "splitserve_kv_transfer_seconds", {"stage": "wire"}),
)


def parse_metrics(text: str) -> dict[SampleKey, float]:
    """Counter totals and histogram/summary `_sum`/`_count` samples of every `splitserve_*`
    family in Prometheus text (buckets, `_created` and gauges are left out)."""
    samples: dict[SampleKey, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(PREFIX) or family.type not in (
                "counter", "histogram", "summary"):
            continue
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            samples[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return samples


def diff_metrics(before: dict[SampleKey, float],
                 after: dict[SampleKey, float]) -> dict[SampleKey, float]:
    """after - before for every sample of `after` (absent before = 0)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


@dataclass(frozen=True)
class HistogramDelta:
    """Observations one histogram series got during the run."""
    name: str
    labels: dict[str, str]
    count: float
    sum_s: float

    @property
    def mean_ms(self) -> float | None:
        return self.sum_s / self.count * 1e3 if self.count else None


@dataclass(frozen=True)
class CounterDelta:
    name: str  # the sample name, `_total` included
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class ServerBreakdown:
    """Every `splitserve_*` histogram and counter series' change over the run."""
    histograms: list[HistogramDelta]
    counters: list[CounterDelta]

    def histogram(self, name: str, labels: dict[str, str] | None = None) -> HistogramDelta | None:
        for h in self.histograms:
            if h.name == name and h.labels == (labels or {}):
                return h
        return None

    def counters_of(self, name: str) -> list[CounterDelta]:
        """The series of counter `name` (with or without `_total`)."""
        total = name if name.endswith("_total") else name + "_total"
        return [c for c in self.counters if c.name == total]


def server_breakdown(before: str | None, after: str | None) -> ServerBreakdown | None:
    """The breakdown between two scrapes; None when either is missing or has no
    `splitserve_*` metric."""
    if before is None or after is None:
        return None
    delta = diff_metrics(parse_metrics(before), parse_metrics(after))
    if not delta:
        return None
    histograms, counters = [], []
    for (name, labels), value in sorted(delta.items()):
        if name.endswith("_count"):
            base = name.removesuffix("_count")
            histograms.append(HistogramDelta(base, dict(labels), value,
                                             delta.get((base + "_sum", labels), 0.0)))
        elif not name.endswith("_sum"):
            counters.append(CounterDelta(name, dict(labels), value))
    return ServerBreakdown(histograms, counters)
