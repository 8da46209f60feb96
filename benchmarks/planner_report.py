"""The report of benchmarks/planner.py: the plot of the planner run's workers against the
offered load (with every setup's SLO attainment over time), the docs section's text, and
its hand-written reading kept across runs."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from benchmarks.common import _split_sections, markdown_table
from splitserve.bench import SLO

SECTION = "Planner vs static allocations"
READING = "### Reading (hand-written)"
TARGET = 0.9  # SLO attainment the issue asks of the planner
BIN_S = 10.0  # load and attainment are plotted per this many (compressed) seconds


def per_bin(records: list[list[Any]], slo: SLO, span: float) -> tuple[list[float], ...]:
    """Per BIN_S of arrival time: offered requests/s and the share meeting the SLO."""
    num = math.ceil(span / BIN_S) + 1
    sent, met = [0] * num, [0] * num
    for scheduled, _, out, ttft, tpot, error in records:
        k = int(scheduled // BIN_S)
        sent[k] += 1
        ok = error is None and ttft is not None and ttft * 1e3 <= (slo.ttft_ms or math.inf)
        met[k] += ok and (tpot is None or tpot * 1e3 <= (slo.tpot_ms or math.inf))
    starts = [k * BIN_S for k in range(num)]
    return (starts, [c / BIN_S for c in sent],
            [m / c if c else math.nan for m, c in zip(met, sent)])


def plot(rows: list[dict[str, Any]], slo: SLO, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    planner = next(r for r in rows if r["setup"] == "planner")
    span = max(r["duration_s"] for r in rows)
    fig, (top, low) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    starts, load, _ = per_bin(planner["records"], slo, span)
    top.bar(starts, load, width=BIN_S, align="edge", color="0.85", label="offered load")
    top.set_ylabel(f"requests/s (per {BIN_S:g} s)")
    workers = top.twinx()
    t = [x["t"] for x in planner["samples"]]
    for label, count, style in (
            ("worker processes (starting too)", lambda x: x["processes"],
             {"color": "0.3", "linewidth": 4, "alpha": 0.35}),
            ("prefill workers", lambda x: x["roles"].get("prefill", 0), {"color": "C1"}),
            ("decode / colocated workers", lambda x: x["roles"].get("decode", 0)
             + x["roles"].get("both", 0), {"color": "C2"})):
        workers.step(t, [count(x) for x in planner["samples"]], where="post", label=label,
                     **style)
    workers.set_ylabel("workers (planner run)")
    workers.set_ylim(0, 3)
    lines = top.get_legend_handles_labels()
    more = workers.get_legend_handles_labels()
    top.legend(lines[0] + more[0], lines[1] + more[1], loc="upper left", fontsize=8)
    top.set_title("Planner on (budget 2): workers per pool against the offered load")
    for row in rows:
        s, _, share = per_bin(row["records"], slo, span)
        low.plot([x + BIN_S / 2 for x in s], share, marker=".", label=row["setup"])
    low.axhline(TARGET, color="0.5", linestyle="--", linewidth=0.8)
    low.set_ylabel("share meeting the SLO")
    low.set_ylim(-0.02, 1.05)
    low.set_xlabel("seconds since the first arrival (compressed trace time)")
    low.set_xlim(0, span)
    low.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verdict(rows: list[dict[str, Any]]) -> str:
    planner = next(r for r in rows if r["setup"] == "planner")
    meeting = [r for r in rows if r["setup"] != "planner" and r["attainment"] >= TARGET]
    best = min(meeting, key=lambda r: r["worker_seconds"], default=None)
    text = (f"Target (issue 20): the planner meets the SLO for {TARGET:.0%} of requests with "
            f"fewer worker-seconds than any static allocation that meets it. Planner: "
            f"{planner['attainment']:.0%}, {planner['worker_seconds']:.0f} worker-s. ")
    if best is None:
        return text + "No static allocation met the SLO."
    met = planner["attainment"] >= TARGET
    fewer = planner["worker_seconds"] < best["worker_seconds"]
    return text + (f"Cheapest static allocation meeting it: `{best['setup']}`, "
                   f"{best['worker_seconds']:.0f} worker-s. **Target "
                   f"{'met' if met and fewer else 'not met'}**"
                   + ("" if met else " (the planner missed the SLO)")
                   + ("" if fewer or not met else " (not fewer worker-seconds)") + ".")


def render(rows: list[dict[str, Any]], info: dict[str, Any], doc_dir: Path, out: Path) -> str:
    slo, planner = info["slo"], next((r for r in rows if r["setup"] == "planner"), None)
    table = [[f"`{r['setup']}`", r["layout"], f"{r['attainment']:.0%}",
              f"{r['ttft_attainment']:.0%} / {r['tpot_attainment']:.0%}", f"{r['goodput']:.2f}",
              "{:.0f} / {:.0f}".format(*(x or 0 for x in r["ttft_ms"])),
              "{:.1f} / {:.1f}".format(*(x or 0 for x in r["tpot_ms"])),
              f"{r['worker_seconds']:.0f} ({r['mean_workers']:.2f})", f"{r['failed']}/{r['sent']}",
              f"{r['cpu_others']:.2f}"] for r in rows]
    steps = "; ".join(x.replace("splitserve_planner_steps_total", "")
                      for x in planner["planner_steps"]) if planner else ""
    load = next((x["model_load"] for x in reversed(planner["samples"]) if x["model_load"]),
                None) if planner else None
    busy = [f"{r['setup']}: {'; '.join(r['busy'])}" for r in rows if r["busy"]]
    return "\n".join([
        f"Workload: {info['scaling']}. Arrivals replay the kept requests' timestamps (no "
        "jitter); prompts are fresh random tokens (no prefix hits), the same in every setup.",
        "", f"SLO: TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms, both "
        f"needed. Every server: `{' '.join(info['common'])}` (one torch thread per worker: "
        f"one core each); the planner decides every {info['interval_s']:g} s.", "",
        markdown_table(["setup", "`splitserve serve` flags"],
                       [[f"`{x['name']}`", f"`{' '.join(x['flags'])}`"]
                        for x in info["setups"]]), "",
        markdown_table(["setup", "layout", "SLO attainment", "TTFT / TPOT met",
                        "goodput (req/s)", "TTFT ms p50 / p90", "TPOT ms p50 / p90",
                        "worker-s (mean workers)", "failed", "other CPU (cores)"], table), "",
        verdict(rows) if planner else "", "",
        f"Planner steps (`/metrics`): {steps or 'none'}; model-load time it used at the end "
        f"(`/admin/health`): " + (f"{load['seconds']:.1f} s ({load['source']}, "
                                  f"{load['samples']} starts)" if load else "-")
        + ". Worker-seconds integrate the live worker processes "
        "(starting, serving or draining) from the first arrival to the last response, "
        "sampled every second. Other CPU: what processes outside this benchmark used "
        "meanwhile (of 2 cores)." + (f" Busy then: {' | '.join(busy)}." if busy else ""), "",
        f"![workers per pool against the offered load]"
        f"({os.path.relpath(out / 'planner_workers.png', doc_dir)})", "",
        "Top: the planner run's workers against the offered load; bottom: the share of each "
        "bin's arrivals that met the SLO, per setup. **On 2 cores an added worker competes "
        "for the same two cores** with the first one, the frontend and the load generator "
        "(and while it starts, its imports and weight loading take CPU from the serving "
        "worker): scaling up here can add at most one core, not a machine, so what the "
        "planner can show is limited."])


def kept_reading(doc: Path) -> str:
    text = doc.read_text() if doc.exists() else ""
    body = next((b for title, b in _split_sections(text)[1] if title == SECTION), "")
    start = body.find(READING)
    return body[start:].strip() if start >= 0 else f"{READING}\n\n_Not written yet._"
