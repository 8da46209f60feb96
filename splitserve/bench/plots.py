"""PNG plots (matplotlib, Agg backend): TTFT and TPOT CDFs of runs, and SLO attainment
against request rate for one or several labelled sweeps (e.g. agg vs disagg)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from splitserve.bench.markdown import slo_text
from splitserve.bench.report import BenchReport, SweepReport


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _run_name(run: BenchReport) -> str:
    rate = run.arrivals.rate
    if rate is None:
        return f"{run.label} (trace timing)"
    return f"{run.label} @ {'inf' if math.isinf(rate) else f'{rate:g}'} req/s"


def plot_cdf(runs: Sequence[BenchReport], metric: str, path: str | Path) -> Path:
    """One CDF line per run of `metric` ("ttft" or "tpot", milliseconds), with the run's SLO
    target as a dashed vertical line when one was given."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    targets = set()
    for run in runs:
        done = [r for r in run.records if r.is_completed]
        values = [getattr(r, f"{metric}_s") for r in done]
        ms = sorted(v * 1e3 for v in values if v is not None)
        if ms:
            fractions = [(i + 1) / len(ms) for i in range(len(ms))]
            ax.step([ms[0], *ms], [0.0, *fractions], where="post", label=_run_name(run))
        target = getattr(run.metrics.slo, f"{metric}_ms")
        if target is not None:
            targets.add(target)
    for target in sorted(targets):
        ax.axvline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel(f"{metric.upper()} (ms)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize="small")
        ax.set_title(f"{metric.upper()} CDF")
    return _save(fig, plt, path)


def plot_attainment(sweeps: Sequence[SweepReport], path: str | Path,
                    target: float = 0.9) -> Path:
    """SLO attainment vs request rate, one line per sweep (its label), the target dashed.
    Runs at rate inf (all at once) have no place on the axis and are left out."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for sweep in sweeps:
        points = sorted((rate, run.metrics.slo_attainment)
                        for rate, run in zip(sweep.rates, sweep.runs) if math.isfinite(rate))
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=sweep.label)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    slo = sweeps[0].runs[0].metrics.slo if sweeps and sweeps[0].runs else None
    if slo is not None:
        ax.set_title(f"SLO attainment ({slo_text(slo)})", fontsize="medium")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    out = Path(path)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
