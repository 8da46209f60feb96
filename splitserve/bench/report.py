"""BenchReport (one run) and SweepReport (one run per rate): the bench's results, as JSON
(every per-request record, the summary, config, machine, command and date)."""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

from splitserve.bench.arrivals import ArrivalInfo
from splitserve.bench.client import ServerInfo
from splitserve.bench.config import BenchConfig
from splitserve.bench.metrics import RunMetrics
from splitserve.bench.record import RequestRecord
from splitserve.bench.server_metrics import ServerBreakdown
from splitserve.bench.workload import WorkloadInfo


def machine_info() -> dict[str, Any]:
    """The client machine, as the report records it."""
    return {"platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "cpus": os.cpu_count(),
            "python": platform.python_version(), "hostname": platform.node()}


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass
class BenchReport:
    """One run: what was sent, how, and what came back."""
    config: BenchConfig
    server: ServerInfo
    workload: WorkloadInfo
    arrivals: ArrivalInfo
    metrics: RunMetrics
    server_breakdown: ServerBreakdown | None
    records: list[RequestRecord]
    command: str | None = None
    date: str = field(default_factory=now_iso)
    machine: dict[str, Any] = field(default_factory=machine_info)

    @property
    def label(self) -> str:
        return self.config.label

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "label": self.label, "date": self.date, "command": self.command,
            "machine": self.machine, "config": self.config, "server": self.server,
            "workload": self.workload, "arrivals": self.arrivals, "summary": self.metrics,
            "server_breakdown": self.server_breakdown, "requests": self.records})


@dataclass
class SweepReport:
    """One run per rate, same workload (lengths and arrival draws) and a fresh token salt
    per run. `label` names the configuration (e.g. "disagg") in attainment plots."""
    label: str
    runs: list[BenchReport]
    command: str | None = None
    date: str = field(default_factory=now_iso)
    machine: dict[str, Any] = field(default_factory=machine_info)

    @property
    def rates(self) -> list[float]:
        return [r.arrivals.rate if r.arrivals.rate is not None else math.inf for r in self.runs]

    def max_rate_meeting(self, target: float = 0.9) -> float | None:
        """The highest swept rate whose SLO attainment is >= `target` while every lower rate's
        is too (None when even the lowest misses)."""
        best = None
        for rate, run in sorted(zip(self.rates, self.runs), key=lambda x: x[0]):
            if run.metrics.slo_attainment < target:
                break
            best = rate
        return best

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per rate: load, counts, latency percentiles, attainment, goodput."""
        rows = []
        for rate, run in zip(self.rates, self.runs):
            m = run.metrics
            rows.append({
                "rate": rate, "mean_rate": run.arrivals.mean_rate, "sent": m.num_sent,
                "completed": m.num_completed, "failed": m.num_failed,
                "request_throughput": m.request_throughput,
                "output_throughput": m.output_throughput,
                "ttft_p50_ms": m.ttft_ms.median, "ttft_p90_ms": m.ttft_ms.p90,
                "tpot_p50_ms": m.tpot_ms.median, "tpot_p90_ms": m.tpot_ms.p90,
                "slo_attainment": m.slo_attainment, "goodput": m.goodput})
        return rows

    def to_dict(self) -> dict[str, Any]:
        return jsonable({"label": self.label, "date": self.date, "command": self.command,
                         "machine": self.machine, "summary": self.summary_rows(),
                         "runs": [run.to_dict() for run in self.runs]})


def jsonable(value: Any) -> Any:
    """Dataclasses -> dicts, tuples -> lists, inf -> "inf", nan -> None (strict JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def write_json(report: BenchReport | SweepReport, path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report.to_dict(), f, indent=1, allow_nan=False)
        f.write("\n")


def command_line() -> str:
    """This process's command line, as the report records it (`python -m splitserve.cli`
    is written as `splitserve`, the command a reader reruns)."""
    program = os.path.basename(sys.argv[0]) or "python"
    program = "splitserve" if program == "cli.py" else program
    return " ".join([program, *sys.argv[1:]])
