"""`splitserve bench`: a load generator and SLO-goodput meter for any OpenAI-compatible
server, over HTTP only (no engine code is imported).

Library use (what `splitserve bench` and the goodput study call):

    from splitserve.bench import BenchConfig, LengthDist, SLO, run_bench, run_sweep
    report = run_bench(BenchConfig(base_url="http://127.0.0.1:8000", rate=2.0,
                                   input_len=LengthDist("fixed", 1024), slo=SLO(500, 50)))
    report.metrics.slo_attainment, report.metrics.goodput
    sweep = run_sweep(BenchConfig(label="disagg", ...), rates=[1, 2, 4])
    plot_attainment([sweep_agg, sweep_disagg], "attainment.png")
"""
from __future__ import annotations

from splitserve.bench.config import SLO, BenchConfig, LengthDist
from splitserve.bench.errors import BenchSetupError
from splitserve.bench.markdown import run_markdown, sweep_markdown
from splitserve.bench.metrics import RunMetrics, Stats, compute_metrics
from splitserve.bench.plots import plot_attainment, plot_cdf
from splitserve.bench.record import RequestRecord
from splitserve.bench.report import BenchReport, SweepReport, write_json
from splitserve.bench.runner import run_bench, run_sweep

__all__ = ["SLO", "BenchConfig", "BenchReport", "BenchSetupError", "LengthDist",
           "RequestRecord", "RunMetrics", "Stats", "SweepReport", "compute_metrics",
           "plot_attainment", "plot_cdf", "run_bench", "run_markdown", "run_sweep",
           "sweep_markdown", "write_json"]
