"""Planner vs static allocations (issue 20): the Azure 2023 conversation trace, its rate
changes kept, scaled to this machine, replayed against `--planner on` with a budget of 2
workers and against every static allocation of 2 one-core workers.

    python benchmarks/planner.py                   # ~25 min; writes docs/benchmarks.md
    python benchmarks/planner.py --quick           # ~4 min, the pipeline only; no doc
    python benchmarks/planner.py --calibrate 0.5,1 # constant rates on agg1 and agg2

The trace (`../shared/data/traces/azure2023_conv.csv`, 19,366 requests over 58 min: per
2 min 456 at the start, 955 at minute 30, 470 at minute 48) is scaled (`Scaling`): every
k-th request kept, lengths x a factor and cut to the context, inter-arrival times x a
factor, so the whole hour's shape plays in a few minutes at rates this CPU serves. One
server at a time, each started, warmed up (2 requests), given the same requests at the
same times, stopped. Every second a thread counts the server's live worker processes
(starting, serving or draining: each holds a core) and reads `/admin/health` (registered
workers by role, the planner's decision); worker-seconds integrate the process count over
the run (first arrival to last response). One core per worker everywhere (one torch
thread), so worker-seconds are core-seconds.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT, _ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from benchmarks.common import (DEFAULT_OUTPUT, busy_processes,  # noqa: E402
                               machine_description, other_cpu_load, write_section)
from benchmarks.planner_report import SECTION, kept_reading, plot, render  # noqa: E402
from benchmarks.ray_overhead import CpuSplit, _children, _cmdline  # noqa: E402
from splitserve.bench import SLO, BenchConfig, LengthDist, run_bench  # noqa: E402
from splitserve.bench.traces import TraceRecord, read_trace  # noqa: E402

OUT = _ROOT / "docs/bench/planner"
POLL_S = 1.0  # how often the workers are counted


@dataclass(frozen=True)
class Scaling:
    """How the trace is made to fit a 2-core CPU and a few minutes."""
    keep_every: int  # requests kept: trace indices 0, k, 2k, ...
    length_scale: float  # prompt and output lengths x this (rounded, >= 1)
    max_model_len: int  # the servers' context: prompts cut so prompt + output fit
    time_scale: float  # inter-arrival times x this

    def rate_factor(self) -> float:
        """Served rate / trace rate."""
        return 1 / (self.keep_every * self.time_scale)


# Every 64th request: 0.71 -> 1.49 -> 0.73 req/s. One one-core worker serves the ends
# within the SLO and not the peak (2026-11-24: agg1 72%), two serve it all: the budget
# matters. Every 80th (0.57 -> 1.19): one worker met 90% alone (94%), so no planner could
# use fewer worker-seconds; every 48th (0.95 -> 1.99) overloaded every setup.
FULL = Scaling(keep_every=64, length_scale=1 / 4, max_model_len=2048, time_scale=1 / 12)
QUICK = Scaling(keep_every=480, length_scale=1 / 4, max_model_len=2048, time_scale=1 / 120)
# From --calibrate on one thread: a p90 prompt (659 tokens) takes 1.09 s unloaded, so a
# 1.5 s TTFT failed >10% of requests at any rate (the longer prompts alone); 3 s is ~3x
# the p90's unloaded TTFT, as in benchmarks/kv_store.py. TPOT: unloaded 15 ms.
SLO_MS = SLO(ttft_ms=3000, tpot_ms=80)
# The planner's interval for a trace compressed 12x (an hour in 5 min): its windows are
# multiples of it (scale-down: 12 intervals), so they fit the compressed rate changes.
INTERVAL_S = 2.5


@dataclass(frozen=True)
class Setup:
    name: str
    flags: tuple[str, ...]
    layout: str


def setups(interval_s: float) -> list[Setup]:
    return [
        Setup("planner", ("--mode", "disagg", "--prefill", "0", "--decode", "1", "--planner",
                          "on", "--planner-max-workers", "2", "--planner-interval-s",
                          f"{interval_s:g}"),
              "starts as 1 colocated worker; the planner picks the layout and 1-2 workers"),
        Setup("agg1", ("--mode", "agg", "--decode", "1"), "1 colocated worker"),
        Setup("agg2", ("--mode", "agg", "--decode", "2"), "2 colocated workers"),
        Setup("disagg", ("--mode", "disagg", "--prefill", "1", "--decode", "1"),
              "1 prefill + 1 decode worker (`--disagg-policy auto`)"),
    ]


def common_flags(scaling: Scaling, slo: SLO) -> list[str]:
    return ["--threads-per-worker", "1", "--max-model-len", str(scaling.max_model_len),
            "--slo-ttft-ms", f"{slo.ttft_ms:g}", "--slo-tpot-ms", f"{slo.tpot_ms:g}"]


# -- the workload ------------------------------------------------------------------------
def thin_trace(records: list[TraceRecord], scaling: Scaling, path: Path) -> list[TraceRecord]:
    """Every k-th request, written as an Azure CSV at `path` (lengths and times unscaled:
    the load generator scales them, so the report names the factors)."""
    kept = records[::scaling.keep_every]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        out.writerows([r.timestamp_s, r.input_len, r.output_len] for r in kept)
    return kept


def scaling_text(full: list[TraceRecord], kept: list[TraceRecord], s: Scaling) -> str:
    """What was replayed (printed, and written with the results)."""
    counts = [0] * (1 + int(full[-1].timestamp_s // 120))
    for r in full:
        counts[int(r.timestamp_s // 120)] += 1
    counts = counts[:-1]  # the last 2 minutes are partial
    peak = counts.index(max(counts))
    low = counts.index(min(counts[peak:]), peak)
    span = (kept[-1].timestamp_s - kept[0].timestamp_s) * s.time_scale
    rate = lambda n: n / 120 * s.rate_factor()  # noqa: E731
    return (f"the Azure 2023 conversation trace, {len(full)} requests over "
            f"{full[-1].timestamp_s / 60:.0f} min, per 2 min {counts[0]} (start) -> "
            f"{counts[peak]} (minute {2 * peak}) -> {counts[low]} (minute {2 * low}); kept "
            f"every {s.keep_every}th request ({len(kept)}), lengths x{s.length_scale:g} and "
            f"cut to a {s.max_model_len}-token context, times x{s.time_scale:.4g} (the hour in "
            f"{span:.0f} s; 2 min of trace = {120 * s.time_scale:.0f} s), so the served rate "
            f"is the trace's x{s.rate_factor():.3g}: {rate(counts[0]):.2f} -> "
            f"{rate(counts[peak]):.2f} -> {rate(counts[low]):.2f} req/s")


def bench_config(url: str, trace: Path, n: int, s: Scaling, slo: SLO, **extra: Any
                 ) -> BenchConfig:
    return BenchConfig(**{"base_url": url, "workload": "azure", "trace": str(trace),
                          "num_requests": n, "length_scale": s.length_scale,
                          "time_scale": s.time_scale, "max_model_len": s.max_model_len,
                          "slo": slo, "run_index": 7, "request_timeout_s": 300, **extra})


# -- watching the server -------------------------------------------------------------------
def worker_processes(frontend_pid: int) -> int:
    """The frontend's worker children alive now (`python -m splitserve.cluster.worker`
    while it starts, `splitserve-<id>` once it set its title)."""
    return sum(1 for pid in _children().get(frontend_pid, [])
               if "splitserve.cluster.worker" in _cmdline(pid)
               or _cmdline(pid).startswith("splitserve-"))


class Poller:
    """Samples (perf_counter s, worker processes, registered workers by role, planner
    decision) every POLL_S in a thread."""

    def __init__(self, server: Any) -> None:
        self.server, self.samples = server, list[dict[str, Any]]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t, procs = time.perf_counter(), worker_processes(self.server.proc.pid)
            try:
                health = self.server.get_json("/admin/health")
            except OSError:
                health = {}
            roles: dict[str, int] = {}
            for w in health.get("workers", []):
                key = "draining" if w.get("draining") else w["role"]
                roles[key] = roles.get(key, 0) + 1
            plan = health.get("planner") or {}
            self.samples.append({"t": t, "processes": procs, "roles": roles,
                                 "target": [plan.get("layout"), plan.get("prefill"),
                                            plan.get("decode")] if plan else None,
                                 "model_load": plan.get("model_load")})
            self._stop.wait(POLL_S)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def worker_seconds(samples: list[dict[str, Any]], t0: float, t1: float) -> float:
    """The integral of live worker processes over [t0, t1], each sample held until the
    next."""
    total = 0.0
    for a, b in zip(samples, samples[1:] + [{"t": math.inf}]):
        lo, hi = max(a["t"], t0), min(b["t"], t1)
        total += a["processes"] * max(0.0, hi - lo)
    return total


def wait_quiet(max_wait_s: float, threshold: float = 0.3) -> float:
    """Waits (up to `max_wait_s`) until other processes use < `threshold` cores over 5 s
    (the machine is shared: others' tests come and go); the seconds waited."""
    t0 = time.monotonic()
    while other_cpu_load(5.0) >= threshold and time.monotonic() - t0 < max_wait_s:
        pass
    return time.monotonic() - t0


@contextmanager
def serving(setup: Setup, extra: list[str], max_wait_s: float = 0.0) -> Iterator[Any]:
    from conftest import ServerProcess
    flags = [*setup.flags, *extra]
    if max_wait_s > 0:
        print(f"  waited {wait_quiet(max_wait_s):.0f} s for a quiet machine", flush=True)
    print(f"  starting {setup.name}: splitserve serve {' '.join(flags)}", flush=True)
    server = ServerProcess(*flags)
    try:
        yield server
    finally:
        server.stop()


def run_setup(setup: Setup, trace: Path, n: int, s: Scaling, slo: SLO,
              interval_s: float, max_wait_s: float) -> dict[str, Any]:
    with serving(setup, common_flags(s, slo), max_wait_s) as server:
        run_bench(BenchConfig(base_url=server.url, num_requests=2, rate=math.inf,
                              input_len=LengthDist("fixed", 64),
                              output_len=LengthDist("fixed", 4), run_index=1, label="warmup"))
        if setup.name == "planner":  # the warm-up must not leave it above its minimum
            time.sleep(interval_s)
        split = CpuSplit([server.proc.pid]).start()
        with Poller(server) as poller:
            report = run_bench(bench_config(server.url, trace, n, s, slo, label=setup.name))
            end = time.perf_counter() - 0.5  # run_bench waits 0.5 s after the last response
            time.sleep(POLL_S)
        cpu = split.stop()
        steps = [line for line in server.get_text("/metrics").splitlines()
                 if line.startswith("splitserve_planner_steps_total{")]
    m = report.metrics
    t0 = end - m.duration_s
    for sample in poller.samples:
        sample["t"] = round(sample["t"] - t0, 2)  # seconds since the first arrival
    ws = worker_seconds(poller.samples, 0.0, m.duration_s)
    row = {"setup": setup.name, "flags": " ".join(setup.flags), "layout": setup.layout,
           "attainment": m.slo_attainment, "ttft_attainment": m.ttft_attainment,
           "tpot_attainment": m.tpot_attainment, "goodput": m.goodput,
           "ttft_ms": [m.ttft_ms.median, m.ttft_ms.p90], "tpot_ms": [m.tpot_ms.median,
                                                                     m.tpot_ms.p90],
           "failed": m.num_failed, "sent": m.num_sent, "duration_s": m.duration_s,
           "worker_seconds": ws, "mean_workers": ws / m.duration_s if m.duration_s else 0,
           "cpu_others": cpu["others"], "cpu_ours": cpu["ours"],
           "busy": busy_processes()[:3] if cpu["others"] > 0.2 else [],
           "planner_steps": [line for line in steps if not line.endswith(" 0.0")],
           "samples": poller.samples,
           "records": [[r.scheduled_s, r.prompt_len, r.output_tokens, r.ttft_s, r.tpot_s,
                        r.error] for r in report.records]}
    print(f"  {setup.name}: attainment {m.slo_attainment:.0%} (TTFT {m.ttft_attainment:.0%},"
          f" TPOT {m.tpot_attainment:.0%}), goodput {m.goodput:.2f} req/s, TTFT p50/p90 "
          f"{m.ttft_ms.median or 0:.0f}/{m.ttft_ms.p90 or 0:.0f} ms, TPOT p50/p90 "
          f"{m.tpot_ms.median or 0:.1f}/{m.tpot_ms.p90 or 0:.1f} ms, {ws:.0f} worker-s over "
          f"{m.duration_s:.0f} s, failed {m.num_failed}, other CPU {cpu['others']:.2f} cores"
          + (f"; planner steps: {row['planner_steps']}" if steps else ""), flush=True)
    return row


# -- calibration: constant rates ------------------------------------------------------------
def calibrate(kept: list[TraceRecord], rates: list[float], s: Scaling, slo: SLO, n: int,
              names: list[str], path: Path) -> None:
    """Steady load of the run's own requests: `n` of the kept ones (shuffled, seeded) at
    Poisson times, rescaled to each mean rate, on each setup named; and the unloaded TTFT
    and TPOT of a p90 prompt on agg1 (the SLO is a multiple of those)."""
    rng = random.Random(0)
    sample = rng.sample(kept, min(n, len(kept)))
    t = 0.0
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for r in sample:
            out.writerow([t, r.input_len, r.output_len])
            t += rng.expovariate(1.0)
    lengths = sorted(r.input_len for r in kept)
    p90 = round(lengths[int(0.9 * len(lengths))] * s.length_scale)
    median_out = round(sorted(r.output_len for r in kept)[len(kept) // 2] * s.length_scale)
    for setup in (x for x in setups(INTERVAL_S) if x.name in names):
        with serving(setup, common_flags(s, slo), 300) as server:
            if setup.name == "agg1":
                wait_quiet(300)
                m = run_bench(BenchConfig(base_url=server.url, num_requests=3, rate=math.inf,
                                          input_len=LengthDist("fixed", p90),
                                          output_len=LengthDist("fixed", max(2, median_out)),
                                          max_concurrency=1, run_index=2)).metrics
                print(f"  unloaded, {p90}-token prompt, {median_out} output tokens: TTFT "
                      f"{m.ttft_ms.median or 0:.0f} ms, TPOT {m.tpot_ms.median or 0:.1f} ms")
            for i, rate in enumerate(rates):
                wait_quiet(300)
                split = CpuSplit([server.proc.pid]).start()
                m = run_bench(bench_config(server.url, path, len(sample), s, slo, rate=rate,
                                           time_scale=None, run_index=20 + i)).metrics
                print(f"  {setup.name} @ {rate:g} req/s: attainment {m.slo_attainment:.0%} "
                      f"(TTFT {m.ttft_attainment:.0%}, TPOT {m.tpot_attainment:.0%}); TTFT "
                      f"p50/p90 {m.ttft_ms.median or 0:.0f}/{m.ttft_ms.p90 or 0:.0f} ms, "
                      f"TPOT {m.tpot_ms.median or 0:.1f}/{m.tpot_ms.p90 or 0:.1f} ms; other "
                      f"CPU {split.stop()['others']:.2f} cores", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short trace, no doc")
    ap.add_argument("--calibrate", metavar="RATES", help="steady rates (req/s), agg1 and agg2 "
                    "unless --setups says")
    ap.add_argument("--calibrate-requests", type=int, default=80)
    ap.add_argument("--setups", help="comma-separated (default: all; --calibrate: agg1,agg2)")
    ap.add_argument("--slo-ttft-ms", type=float, default=SLO_MS.ttft_ms)
    ap.add_argument("--slo-tpot-ms", type=float, default=SLO_MS.tpot_ms)
    ap.add_argument("--interval-s", type=float, default=INTERVAL_S, help="the planner's")
    ap.add_argument("--keep-every", type=int, help="keep every k-th trace request (the "
                    f"rate; default {FULL.keep_every})")
    ap.add_argument("--out", type=Path, help="JSON and PNG (default docs/bench/planner, "
                    "--quick: a temporary directory)")
    ap.add_argument("--doc", type=Path, default=_ROOT / DEFAULT_OUTPUT)
    ap.add_argument("--max-wait-s", type=float, default=300,
                    help="before each setup, wait this long at most for a quiet machine")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so servers are stopped
    s, slo = (QUICK if args.quick else FULL), SLO(args.slo_ttft_ms, args.slo_tpot_ms)
    if args.keep_every:
        s = replace(s, keep_every=args.keep_every)
    names = (args.setups or ("agg1,agg2" if args.calibrate else
                             ",".join(x.name for x in setups(0)))).split(",")
    full = read_trace("azure", None, None)
    work = Path(tempfile.mkdtemp(prefix="splitserve-planner-"))  # the trace is not copied
    trace = work / "kept.csv"
    kept = thin_trace(full, s, trace)
    if args.calibrate:
        calibrate(kept, [float(x) for x in args.calibrate.split(",")], s, slo,
                  args.calibrate_requests, names, work / "steady.csv")
        return 0
    out = args.out or (work if args.quick else OUT)
    out.mkdir(parents=True, exist_ok=True)
    info = {"scaling": scaling_text(full, kept, s), "scaling_factors": asdict(s),
            "slo": asdict(slo), "interval_s": args.interval_s,
            "common": common_flags(s, slo), "setups": [asdict(x) for x in setups(
                args.interval_s) if x.name in names]}
    print(info["scaling"], flush=True)
    print(f"planner interval {args.interval_s:g} s; SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= "
          f"{slo.tpot_ms:g} ms; busy processes now: {busy_processes()[:3]}", flush=True)
    t0 = time.monotonic()
    rows = [run_setup(x, trace, len(kept), s, slo, args.interval_s, args.max_wait_s)
            for x in setups(args.interval_s) if x.name in names]
    (out / "results.json").write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    if any(r["setup"] == "planner" for r in rows):
        plot(rows, slo, out / "planner_workers.png")
    doc = args.doc.resolve()
    body = render(rows, info, doc.parent, out)
    print(body + f"\n\ndone in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    if not args.quick and len(rows) == len(setups(args.interval_s)):  # partial: no doc
        write_section(str(doc), SECTION, body + "\n\n" + kept_reading(doc),
                      machine=machine_description())
        print(f"wrote the {SECTION!r} section of {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
