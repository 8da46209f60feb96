"""Markdown summaries of a BenchReport or SweepReport (what `splitserve bench` prints)."""
from __future__ import annotations

import math
from collections.abc import Sequence

from splitserve.bench.config import SLO
from splitserve.bench.report import BenchReport, SweepReport
from splitserve.bench.server_metrics import PHASES, ServerBreakdown


def _num(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def slo_text(slo: SLO) -> str:
    parts = [f"TTFT <= {slo.ttft_ms:g} ms" if slo.ttft_ms is not None else "",
             f"TPOT <= {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else ""]
    given = " and ".join(p for p in parts if p)
    return given or "none given (attainment = completed / sent)"


def _header(report: BenchReport) -> list[str]:
    s, w = report.server, report.workload
    lines = [f"- date: {report.date}; command: `{report.command or '(library call)'}`",
             f"- server: {s.base_url}, model `{s.model}`, max_model_len "
             f"{s.max_model_len if s.max_model_len is not None else 'unknown'}",
             f"- client machine: {report.machine.get('platform')}, "
             f"{report.machine.get('cpus')} CPUs",
             f"- workload: {w.description}",
             f"- {w.num_requests} requests; input tokens mean {w.mean_input_len:.0f} / max "
             f"{w.max_input_len}; output tokens mean {w.mean_output_len:.0f} / max "
             f"{w.max_output_len}; reusable prompt prefix {w.prefix_reuse_ratio:.1%}"
             + (f"; {w.num_clamped} clamped to the context" if w.num_clamped else "")
             + (f"; {w.num_dropped} turns dropped (context)" if w.num_dropped else "")]
    if report.config.endpoint == "chat":
        counted = [r.prompt_tokens for r in report.records if r.prompt_tokens is not None]
        if counted:
            lines.append(f"- chat endpoint: prompts are words, one per token id above; the "
                         f"server counted {sum(counted) / len(counted):.0f} prompt tokens "
                         "on average (chat template included)")
    if w.block_size is not None:
        lines.append(f"- mooncake blocks: {w.block_size} tokens per hash id "
                     f"(512 x length scale {w.length_scale:g}, rounded up)")
    return lines


def _arrival_line(report: BenchReport) -> str:
    a = report.arrivals
    text = f"- arrivals: {a.kind}"
    if a.rate is not None and math.isfinite(a.rate):
        text += f", rate {a.rate:g} req/s"
    if a.burstiness is not None and a.kind == "gamma":
        text += f", burstiness {a.burstiness:g}"
    if a.time_scale is not None:
        text += f", time scale x{a.time_scale:.4g}"
    if a.jitter_s:
        text += f", jitter U[0, {a.jitter_s:g}) s"
    if a.mean_rate is not None:
        text += f"; schedule: mean {a.mean_rate:.3g} req/s over {a.span_s:.1f} s"
    return text


def latency_table(report: BenchReport) -> list[str]:
    m = report.metrics
    rows = [[name, str(s.count), _num(s.mean), _num(s.median), _num(s.p90), _num(s.p99)]
            for name, s in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms),
                            ("E2E", m.e2e_ms))]
    return table(["latency (ms)", "n", "mean", "median", "p90", "p99"], rows)


def _counts_table(report: BenchReport) -> list[str]:
    m = report.metrics
    row = [str(m.num_sent), str(m.num_completed), str(m.num_failed), _num(m.duration_s, 2),
           _num(m.request_throughput, 3), _num(m.output_throughput, 1),
           f"{m.output_tokens}/{m.intended_output_tokens}", f"{m.slo_attainment:.1%}",
           _num(m.goodput, 3)]
    return table(["sent", "completed", "failed", "duration s", "req/s", "out tok/s",
                  "out tokens actual/intended", "SLO attainment", "goodput req/s"], [row])


def breakdown_lines(b: ServerBreakdown | None) -> list[str]:
    """The server's per-phase table, router decisions and outcomes."""
    if b is None:
        return ["Server breakdown: none (the server exposes no splitserve_* metrics)."]
    rows = []
    for title, name, labels in PHASES:
        h = b.histogram(name, labels)
        rows.append([title, str(int(h.count)) if h else "-",
                     _num(h.mean_ms if h else None)])
    lines = ["Server breakdown (its /metrics, difference over the run; '-' = not recorded):",
             ""] + table(["phase", "observations", "mean ms"], rows)
    for title, name, key in (("router decisions", "splitserve_router_decisions", "decision"),
                             ("outcomes", "splitserve_requests", "outcome"),
                             ("failures", "splitserve_failures", "kind")):
        parts = [f"{c.labels.get(key, '?')} {c.value:g}" for c in b.counters_of(name) if c.value]
        lines.append(f"- {title}: {', '.join(parts) or 'none'}")
    hits = sum(c.value for c in b.counters_of("splitserve_prefix_cache_hit_tokens"))
    queried = sum(c.value for c in b.counters_of("splitserve_prefix_cache_query_tokens"))
    if queried:
        lines.append(f"- prefix cache: {hits:g} of {queried:g} prompt tokens hit "
                     f"({hits / queried:.1%})")
    return lines


def run_markdown(report: BenchReport, level: int = 2, with_header: bool = True) -> str:
    """The summary of one run (`with_header=False`: without the server/workload lines a
    sweep prints once)."""
    m = report.metrics
    rate = report.arrivals.rate
    at = f" at {_num(rate, 3)} req/s" if rate is not None else " (trace timing)"
    lines = [f"{'#' * level} bench `{report.label}`{at}", ""]
    lines += (_header(report) if with_header else []) + [_arrival_line(report)]
    lines += [f"- SLO: {slo_text(m.slo)}", ""]
    lines += _counts_table(report) + [""] + latency_table(report) + [""]
    lines += breakdown_lines(report.server_breakdown)
    if m.errors:
        lines += ["", "Failed requests by error:"]
        lines += [f"- {count} x {message}" for message, count in m.errors.items()]
    return "\n".join(lines) + "\n"


def sweep_markdown(sweep: SweepReport, target: float = 0.9) -> str:
    """The sweep's table (one row per rate), then each run's summary."""
    first = sweep.runs[0]
    rows = [[_num(r["rate"], 3), _num(r["mean_rate"], 3), str(r["sent"]), str(r["completed"]),
             str(r["failed"]), _num(r["request_throughput"], 3), _num(r["ttft_p90_ms"]),
             _num(r["tpot_p90_ms"]), f"{r['slo_attainment']:.1%}", _num(r["goodput"], 3)]
            for r in sweep.summary_rows()]
    best = sweep.max_rate_meeting(target)
    lines = [f"# bench sweep `{sweep.label}`", ""] + _header(first) + [
        f"- SLO: {slo_text(first.metrics.slo)}", ""]
    lines += table(["rate", "schedule rate", "sent", "completed", "failed", "req/s",
                    "TTFT p90 ms", "TPOT p90 ms", "SLO attainment", "goodput req/s"], rows)
    best_text = f"{_num(best, 3)} req/s" if best is not None else "none of the swept rates"
    lines += ["", f"Highest rate with SLO attainment >= {target:.0%}: {best_text}", ""]
    body = "\n".join(lines) + "\n"
    return body + "\n".join(run_markdown(run, 2, with_header=False) for run in sweep.runs)
