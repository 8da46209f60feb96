"""The goodput study's section of docs/benchmarks.md: one table per workload (what was sent,
the SLO and where it came from, each configuration's goodput and ratio to agg, the command
that measures it again) between the section's hand-written method and reading, which are
kept as they are."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.common import _split_sections, markdown_table
from benchmarks.goodput_setups import WORKLOADS

TARGET = 0.9  # SLO attainment that defines goodput (DistServe)
SECTION = "Goodput study"
METHOD, READING = "### Method (hand-written)", "### Reading (hand-written)"


def _rate_text(row: dict[str, Any]) -> str:
    if row["max_rate"] is None:
        return f"< {_lowest(row):.3g}"
    if row["first_miss"] is None:
        return f">= {row['max_rate']:.3g} (no miss)"
    return f"{row['max_rate']:.3g} (misses at {row['first_miss']:.3g})"


def _lowest(row: dict[str, Any]) -> float:
    return float(min(p[0] for p in row["points"]))


def ratio_text(row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """max rate / agg's; `>` or `<` when one side is only a bound (no pass or no miss)."""
    r, b = row["max_rate"], base["max_rate"] if base else None
    if row is base or base is None or (r is None and b is None):
        return "1" if row is base else "-"
    if b is None:  # agg missed at its lowest tried rate: its max is below it
        return f"> {r / _lowest(base):.2f}x"
    if r is None:
        return f"< {_lowest(row) / b:.2f}x"
    lower, upper = row["first_miss"] is None, base["first_miss"] is None
    if lower and upper:
        return "? (neither missed)"
    return (">= " if lower else "<= " if upper else "") + f"{r / b:.2f}x"


def _arrival_text(t: dict[str, Any]) -> str:
    a = t["arrivals"]
    if a["kind"] != "trace":
        return f"Arrivals: {a['kind']}, open loop."
    return (f"Arrivals: the trace's timestamps, jittered U[0, {a['jitter_s']:g} s), rescaled "
            f"to each rate (unscaled, these {t['num_requests']} requests arrive at "
            f"{a['time_scale'] * a['rate']:.3g} req/s).")


def _rerun(t: dict[str, Any]) -> str:
    """The command that measures this table again: its configurations and, when they were
    given rather than derived, its SLOs."""
    slo = t["calibration"]["slo"]
    flags = (f" --slo-ttft-ms {slo['ttft_ms']:g} --slo-tpot-ms {slo['tpot_ms']:g}"
             if t["calibration"].get("override") else "")
    configs = ",".join(r["config"] for r in t["rows"])
    variant = f" --variant {t['variant']}" if t.get("variant") else ""
    if t.get("length_scale"):
        variant += f" --length-scale {t['length_scale']:g}"
    return (f"python benchmarks/goodput_study.py --table {t.get('table', t['key'])} "
            f"--configs {configs}{flags}{variant}")


def render_table(t: dict[str, Any], doc_dir: Path) -> str:
    """One workload's subsection: what was sent, the SLO and where it came from, the table."""
    w, c, slo = t["workload"], t["calibration"], t["calibration"]["slo"]
    origin = ("given on the command line" if c.get("override") else
              f"{c['k_ttft']:g} x {c['ttft0_ms']:.0f} ms and {c['k_tpot']:g} x "
              f"{c['tpot0_ms']:.1f} ms, the unloaded TTFT and TPOT of a {c['prompt_len']}-token "
              f"prompt with {c['output_len']} output tokens on agg")
    base = next((r for r in t["rows"] if r["config"] == "agg"), None)
    rows = [[f"`{r['config']}`", r["layout"], _rate_text(r), ratio_text(r, base),
             ", ".join(f"{rate:.3g}: {a:.0%}" for rate, a in r["points"]), r["failed"],
             "-" if r["other_cpu_cores"] is None else f"{r['other_cpu_cores']:.2f}"]
            for r in t["rows"]]
    plots = Path(os.path.relpath(t["out"], doc_dir))
    return "\n".join([
        f"### {t['title']}{' (--quick: not a result)' if t['quick'] else ''}", "",
        f"Measured {t['date']} with `{t['command']}` (this table alone: `{_rerun(t)}`); "
        f"machine: {t['machine']}.", "",
        f"Workload: {w['description']}; {t['num_requests']} requests per rate; input tokens "
        f"mean {w['mean_input_len']:.0f} / max {w['max_input_len']}, output mean "
        f"{w['mean_output_len']:.0f}" + (f", {w['num_clamped']} cut to the context"
                                         if w["num_clamped"] else "")
        + (f"; {w['block_size']} tokens per hash id" if w["block_size"] else "")
        + f"; reusable prompt prefix {w['prefix_reuse_ratio']:.1%}. {_arrival_text(t)}", "",
        f"SLO: TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms ({origin}).", "",
        markdown_table(["config", "layout", f"max rate at {TARGET:.0%} (req/s)", "vs agg",
                        "attainment by rate (req/s: share)", "failed", "other CPU (cores)"],
                       rows), "",
        f"Plots: [attainment vs rate]({plots / (t['key'] + '_attainment.png')}), "
        f"[TTFT CDF]({plots / (t['key'] + '_ttft_cdf.png')}) and "
        f"[TPOT CDF]({plots / (t['key'] + '_tpot_cdf.png')}) at {t['cdf_rate']:.3g} req/s."])


def hand_written(doc: Path) -> tuple[str, str]:
    """The section's parts the script keeps as they are: `### Method (hand-written)` up to
    the first table (`### (`) or the reading, and `### Reading (hand-written)` up to the
    section's end."""
    text = doc.read_text() if doc.exists() else ""
    body = next((b for title, b in _split_sections(text)[1] if title == SECTION), "")
    start, reading = body.find(METHOD), body.find(READING)
    ends = [i for i in (body.find("\n### (", start), reading) if i > start]
    method = body[start:min(ends, default=len(body))].strip() if start >= 0 else ""
    return (method or f"{METHOD}\n\nSee `benchmarks/goodput_study.py`.",
            body[reading:].strip() if reading >= 0 else f"{READING}\n\n_Not written yet._")


def tables_in(out: Path) -> list[Path]:
    """Each table's JSON in `out`: per workload the plain table, then its variants
    (`<key>-<variant>.json`; a configuration's sweeps are `<key>_<config>.json`)."""
    found = []
    for key in WORKLOADS:
        plain = out / f"{key}.json"
        found += [plain] if plain.exists() else []
        found += sorted(p for p in out.glob(f"{key}-*.json") if "_" not in p.stem)
    return found


def section_body(doc: Path, out: Path) -> str:
    method, reading = hand_written(doc)
    tables = [render_table(json.loads(path.read_text()), doc.parent) for path in tables_in(out)]
    return "\n\n".join([method, *tables, reading])
