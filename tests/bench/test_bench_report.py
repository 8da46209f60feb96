"""Reports: strict JSON with every record, markdown summaries, PNG plots (CDFs per run,
attainment vs rate for several labelled sweeps), the highest rate meeting a target."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from splitserve.bench.arrivals import ArrivalInfo
from splitserve.bench.client import ServerInfo
from splitserve.bench.config import SLO, BenchConfig
from splitserve.bench.markdown import run_markdown, sweep_markdown
from splitserve.bench.metrics import compute_metrics
from splitserve.bench.plots import plot_attainment, plot_cdf
from splitserve.bench.record import RequestRecord
from splitserve.bench.report import BenchReport, SweepReport, write_json
from splitserve.bench.workload import WorkloadInfo

SLO_ = SLO(ttft_ms=300, tpot_ms=50)


def _report(label: str, rate: float, num_good: int, num_bad: int) -> BenchReport:
    """num_good requests meeting SLO_, num_bad missing its TTFT."""
    records = []
    for i in range(num_good + num_bad):
        first = 0.1 if i < num_good else 0.9
        chunks = [first + 0.02 * k for k in range(4)]
        records.append(RequestRecord(i, 16, 4, 0.0, send_s=0.0, chunk_s=chunks,
                                     end_s=chunks[-1], output_tokens=4, status=200))
    cfg = BenchConfig(label=label, rate=rate, slo=SLO_)
    info = WorkloadInfo("synthetic", "synthetic: input fixed 16, output fixed 4",
                        len(records), 1.0, 2048, 0, 16.0, 16, 4.0, 4, 0.0)
    arrivals = ArrivalInfo("poisson" if math.isfinite(rate) else "all at once", rate, 1.0,
                           None, None, rate if math.isfinite(rate) else None, 1.0)
    return BenchReport(cfg, ServerInfo("http://x", "m", ["m"], 2048), info, arrivals,
                       compute_metrics(records, 2.0, SLO_), None, records, command="bench")


def test_json_is_strict_and_complete(tmp_path: Path) -> None:
    sweep = SweepReport("agg", [_report("agg", math.inf, 3, 1), _report("agg", 2.0, 4, 0)])
    write_json(sweep, tmp_path / "s.json")

    def no_constants(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")
    data = json.loads((tmp_path / "s.json").read_text(), parse_constant=no_constants)
    run = data["runs"][0]
    assert {"label", "date", "command", "machine", "config", "server", "workload", "arrivals",
            "summary", "server_breakdown", "requests"} <= run.keys()
    assert run["config"]["rate"] == "inf" and run["config"]["slo"] == {"ttft_ms": 300,
                                                                       "tpot_ms": 50}
    assert run["summary"]["num_sent"] == 4 and len(run["requests"]) == 4
    assert run["requests"][0]["chunk_s"] == pytest.approx([0.1, 0.12, 0.14, 0.16])
    assert data["summary"][1]["slo_attainment"] == 1.0


def test_markdown_names_the_numbers() -> None:
    text = run_markdown(_report("disagg", 2.0, 3, 1))
    assert "## bench `disagg` at 2.000 req/s" in text
    assert "| 4 | 4 | 0 | 2.00 | 2.000 | 8.0 | 16/16 | 75.0% | 1.500 |" in text
    assert "TTFT <= 300 ms and TPOT <= 50 ms" in text
    assert "| TPOT | 4 | 20.0 | 20.0 | 20.0 | 20.0 |" in text
    assert "Server breakdown: none" in text


def test_max_rate_meeting_the_target() -> None:
    sweep = SweepReport("x", [_report("x", 1.0, 10, 0), _report("x", 2.0, 9, 1),
                              _report("x", 4.0, 5, 5), _report("x", 8.0, 10, 0)])
    assert sweep.max_rate_meeting(0.9) == 2.0  # 8.0 is past the first miss
    assert sweep.max_rate_meeting(0.95) == 1.0
    assert SweepReport("y", [_report("y", 1.0, 1, 9)]).max_rate_meeting(0.9) is None
    assert "Highest rate with SLO attainment >= 90%: 2.000 req/s" in sweep_markdown(sweep)


def test_plots_are_written(tmp_path: Path) -> None:
    agg = SweepReport("agg", [_report("agg", r, 10 - i, i) for i, r in enumerate([1.0, 2.0])])
    dis = SweepReport("disagg", [_report("disagg", r, 10, 0) for r in [1.0, 2.0, math.inf]])
    paths = [plot_attainment([agg, dis], tmp_path / "att.png"),
             plot_cdf(agg.runs + dis.runs, "ttft", tmp_path / "ttft.png"),
             plot_cdf(agg.runs, "tpot", tmp_path / "tpot.png")]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_chat_runs_report_the_servers_prompt_count() -> None:
    report = _report("c", 2.0, 2, 0)
    report.config = BenchConfig(label="c", endpoint="chat", slo=SLO_)
    for r in report.records:
        r.prompt_tokens = 30
    assert "the server counted 30 prompt tokens" in run_markdown(report)
    assert "server counted" not in run_markdown(_report("d", 2.0, 2, 0))
