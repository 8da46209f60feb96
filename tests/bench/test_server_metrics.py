"""Reading the server's /metrics: parse, difference, breakdown — on text made by the
server's own Metrics class, so a renamed server metric fails here."""
from __future__ import annotations

import pytest

from splitserve.bench.server_metrics import (PHASES, diff_metrics, parse_metrics,
                                             server_breakdown)
from splitserve.cluster.frontend.metrics import Metrics


def _text(m: Metrics) -> str:
    return m.text().decode()


def test_parse_keeps_sums_counts_and_counter_totals() -> None:
    m = Metrics()
    m.queue_time.labels("admission").observe(0.25)
    m.router_decisions.labels("remote_faster").inc(2)
    m.kv_blocks_used.labels("decode-0").set(7)  # a gauge: left out
    samples = parse_metrics(_text(m))
    assert samples[("splitserve_queue_time_seconds_count", (("phase", "admission"),))] == 1
    assert samples[("splitserve_queue_time_seconds_sum", (("phase", "admission"),))] == 0.25
    assert samples[("splitserve_router_decisions_total", (("decision", "remote_faster"),))] == 2
    assert not any(name.endswith(("_bucket", "_created")) or "kv_blocks_used" in name
                   for name, _ in samples)


def test_breakdown_is_the_difference_over_the_run() -> None:
    m = Metrics()
    m.ttft.observe(5.0)  # before the run
    m.router_decisions.labels("local_faster").inc()
    before = _text(m)
    m.ttft.observe(0.1)
    m.ttft.observe(0.3)
    m.queue_time.labels("admission").observe(0.02)
    m.transfer_time.labels("total").observe(0.4)
    m.router_decisions.labels("local_faster").inc(3)
    m.router_decisions.labels("remote_faster").inc()
    m.requests.labels("length").inc(2)
    b = server_breakdown(before, _text(m))
    assert b is not None
    ttft = b.histogram("splitserve_time_to_first_token_seconds")
    assert ttft is not None and ttft.count == 2 and ttft.mean_ms == pytest.approx(200.0)
    q = b.histogram("splitserve_queue_time_seconds", {"phase": "admission"})
    assert q is not None and q.mean_ms == pytest.approx(20.0)
    kv = b.histogram("splitserve_kv_transfer_seconds", {"stage": "total"})
    assert kv is not None and kv.count == 1
    assert b.histogram("splitserve_queue_time_seconds", {"phase": "prefill"}) is None
    decisions = {c.labels["decision"]: c.value
                 for c in b.counters_of("splitserve_router_decisions")}
    assert decisions == {"local_faster": 3, "remote_faster": 1}
    assert [c.value for c in b.counters_of("splitserve_requests_total")] == [2]


def test_every_phase_row_names_a_server_metric() -> None:
    names = {name for name, _ in parse_metrics(_text(Metrics()))} | {
        f.name for f in Metrics().registry.collect()}
    for _, metric, _ in PHASES:
        assert metric in names, metric


def test_no_breakdown_without_splitserve_metrics() -> None:
    vllm_like = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
                 "# TYPE vllm:e2e_request_latency_seconds histogram\n"
                 "vllm:e2e_request_latency_seconds_count 3.0\n"
                 "vllm:e2e_request_latency_seconds_sum 1.5\n")
    assert server_breakdown(vllm_like, vllm_like) is None
    assert server_breakdown(None, _text(Metrics())) is None
    assert diff_metrics({("a_total", ()): 1.0}, {("a_total", ()): 4.0, ("b_total", ()): 2.0}) == {
        ("a_total", ()): 3.0, ("b_total", ()): 2.0}
