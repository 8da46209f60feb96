"""Ray runtime overhead: TTFT and TPOT of `splitserve serve --runtime ray` against the
local runtime at equal cores (2), one request at a time and under the goodput study's
workload (a) at its knee, measured in one run.

    python benchmarks/ray_overhead.py          # ~15 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/ray_overhead.py --quick  # ~3 min: 2 rounds, workload (a) / 4; no doc
    python benchmarks/ray_overhead.py --no-agg # disagg only

Ray runs as a local cluster of one head node with 2 CPUs (ray.cluster_utils.Cluster, no
dashboard) that this script starts and shuts down (also on error). Pairs of servers are up
at once, local and Ray, with the same flags; only one of them serves at a time:
1. One streaming request at a time (benchmarks/serving.py's `Served`: 512-token prompt of
   fresh random ids, 64 output tokens, greedy), alternating local/Ray and the order within
   a round; disagg = 1 prefill + 1 decode (`--disagg-policy always`: every request's KV
   crosses TCP), local workers pinned one core each, Ray actors 1 CPU (one thread) each,
   unpinned; agg = one worker, local on both cores, Ray with `--ray-cpus-per-worker 2`.
   Ray minus local = medians of the per-round differences (and ratios).
2. Workload (a) of benchmarks/goodput_study.py (prompts U[1024, 2048], outputs U[64, 128],
   Poisson) on disagg at one rate, its knee (0.177 req/s), under the study's SLO
   (docs/bench/goodput/a_slo.json). Both runtimes get the same requests at the same
   arrival times (same run_index), rounds in the order local, Ray, Ray, local, ...
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT, _ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from benchmarks.common import (DEFAULT_OUTPUT, _split_sections, busy_processes,  # noqa: E402
                               machine_description, markdown_table, median,
                               process_cpu_seconds, write_section)
from benchmarks.goodput_study import WORKLOADS  # noqa: E402
from benchmarks.serving import OUTPUT_TOKENS, PROMPT_TOKENS, Served, Timing  # noqa: E402
from splitserve.bench import (SLO, LengthDist, RequestRecord, compute_metrics,  # noqa: E402
                              run_bench)

SECTION = "Ray runtime overhead"
READING = "### Reading (hand-written)"
KNEE_RATE = 0.177  # docs/benchmarks.md, goodput study (a): disagg's max rate at 90%
RAY_CPUS = 2
MODES = {  # mode -> (local flags, Ray flags, cluster name)
    "disagg": (["--mode", "disagg", "--prefill", "1", "--decode", "1",
                "--disagg-policy", "always"], [], "bench"),
    "agg": (["--mode", "agg", "--decode", "1"], ["--ray-cpus-per-worker", "2"], "bench-agg"),
}
COMMON = ["--max-model-len", "4096"]  # workload (a) prompts reach 2048 + 128 tokens


# -- CPU accounting: this script's process tree vs the rest of the machine ---------------------
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def _subtree(root: int, children: dict[int, list[int]]) -> list[int]:
    todo, found = [root], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class CpuSplit:
    """Cores used between `start` and `stop` by Ray's own processes (GCS, raylet, agents,
    idle workers: descendants of this script outside the servers, worker actors excluded),
    by everything this script started, and by other processes of the machine."""

    def __init__(self, servers: list[int]) -> None:
        self.servers = servers

    def _sample(self) -> tuple[float, float, float, float]:
        children = _children()
        in_servers = {p for s in self.servers for p in _subtree(s, children)}
        ours = [p for p in _subtree(os.getpid(), children) if p != os.getpid()]
        ray_own = [p for p in ours if p not in in_servers and "WorkerActor" not in _cmdline(p)]
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        t = os.times()
        own = t.user + t.system + t.children_user + t.children_system
        return (os.times().elapsed, busy, own + process_cpu_seconds(ours),
                process_cpu_seconds(ray_own))

    def start(self) -> "CpuSplit":
        self._t0 = self._sample()
        return self

    def stop(self) -> dict[str, float]:
        wall, busy, ours, ray_own = (b - a for a, b in zip(self._t0, self._sample()))
        return {"ray": ray_own / wall, "ours": ours / wall,
                "others": max(0.0, busy - ours) / wall}


# -- setups --------------------------------------------------------------------------------
@contextlib.contextmanager
def ray_cluster(cpus: int) -> Iterator[str]:
    """A one-node Ray cluster (this script's children), shut down however we leave."""
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": cpus, "include_dashboard": False})
    try:
        yield str(cluster.address)
    finally:
        cluster.shutdown()


@contextlib.contextmanager
def pair(mode: str, address: str) -> Iterator[dict[str, Served]]:
    """The local and the Ray server of `mode`, both up; stopped (Ray's actors killed, its
    CPUs freed for the next pair) however we leave."""
    local_flags, ray_flags, name = MODES[mode]
    servers: dict[str, Served] = {}
    try:
        servers["local"] = Served([*local_flags, *COMMON])
        servers["ray"] = Served([*local_flags, *COMMON, "--runtime", "ray", "--ray-address",
                                 address, "--cluster-name", name, *ray_flags])
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def single(servers: dict[str, Served], reps: int) -> dict[str, list[Timing]]:
    """One warm-up round, then `reps` rounds of one request per server, the order flipped
    every round; round r sends the same prompt to both."""
    runs: dict[str, list[Timing]] = {name: [] for name in servers}
    for rep in range(-1, reps):
        names = list(servers) if rep % 2 == 0 else list(servers)[::-1]
        for name in names:
            timing = servers[name].run(rep + 100)
            if rep >= 0:
                runs[name].append(timing)
    return runs


def under_load(servers: dict[str, Served], rate: float, n: int, rounds: int, slo: SLO,
               quick: bool) -> dict[str, list[list[RequestRecord]]]:
    """Workload (a) at `rate`: `rounds` runs of `n` requests per server (round r: the same
    requests and arrival times on both), after a 2-request warm-up of long prompts."""
    w = WORKLOADS["a"]
    runs: dict[str, list[list[RequestRecord]]] = {name: [] for name in servers}
    for name, server in servers.items():
        run_bench(w.config(quick, base_url=server.server.url, num_requests=2, rate=math.inf,
                           output_len=LengthDist("fixed", 4), run_index=1, label="warmup"))
    for r in range(rounds):
        names = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for name in names:
            report = run_bench(w.config(quick, base_url=servers[name].server.url,
                                        num_requests=n, rate=rate, slo=slo, run_index=13 + r,
                                        request_timeout_s=300, label=name))
            m = report.metrics
            print(f"  (a) round {r} {name}: attainment {m.slo_attainment:.0%}, TTFT p50 "
                  f"{m.ttft_ms.median or 0:.0f} / p90 {m.ttft_ms.p90 or 0:.0f} ms, TPOT p50 "
                  f"{m.tpot_ms.median or 0:.1f} ms, failed {m.num_failed}", flush=True)
            runs[name].append(report.records)
    return runs


# -- the table --------------------------------------------------------------------------------
def single_rows(mode: str, runs: dict[str, list[Timing]]) -> list[list[str]]:
    ttft = {k: median([t.ttft_s for t in v]) * 1e3 for k, v in runs.items()}
    tpot = {k: median([t.tpot_s for t in v]) * 1e3 for k, v in runs.items()}
    pairs = list(zip(runs["ray"], runs["local"]))
    d_ttft = median([(a.ttft_s - b.ttft_s) * 1e3 for a, b in pairs])
    d_tpot = median([(a.tpot_s - b.tpot_s) * 1e3 for a, b in pairs])
    r_ttft = median([a.ttft_s / b.ttft_s for a, b in pairs])
    r_tpot = median([a.tpot_s / b.tpot_s for a, b in pairs])
    return [[f"{mode}, local", f"{ttft['local']:.1f}", f"{tpot['local']:.2f}", "-", "-"],
            [f"{mode}, Ray", f"{ttft['ray']:.1f}", f"{tpot['ray']:.2f}",
             f"{d_ttft:+.1f} ms ({r_ttft:.2f}x)", f"{d_tpot:+.2f} ms ({r_tpot:.2f}x)"]]


def load_rows(runs: dict[str, list[list[RequestRecord]]], slo: SLO) -> list[list[str]]:
    rows = []
    for name, rounds in runs.items():
        records = [rec for run in rounds for rec in run]
        m = compute_metrics(records, 1.0, slo)  # duration only feeds throughputs, unused
        rows.append([f"disagg, {'Ray' if name == 'ray' else 'local'}", f"{m.slo_attainment:.0%}",
                     f"{m.ttft_ms.median or 0:.0f} / {m.ttft_ms.p90 or 0:.0f}",
                     f"{m.tpot_ms.median or 0:.1f} / {m.tpot_ms.p90 or 0:.1f}",
                     str(m.num_failed)])
    # The same request (round, index) on both runtimes: its Ray minus local latencies.
    d_ttft, d_tpot = [], []
    for ray_run, local_run in zip(runs["ray"], runs["local"]):
        for a, b in zip(ray_run, local_run):
            if a.ttft_s is not None and b.ttft_s is not None:
                d_ttft.append((a.ttft_s - b.ttft_s) * 1e3)
            if a.tpot_s is not None and b.tpot_s is not None:
                d_tpot.append((a.tpot_s - b.tpot_s) * 1e3)
    rows.append(["Ray minus local, per request (median)", "-",
                 f"{median(d_ttft):+.0f}" if d_ttft else "-",
                 f"{median(d_tpot):+.2f}" if d_tpot else "-", "-"])
    return rows


def kept_reading(doc: Path) -> str:
    """The section's hand-written reading, kept across runs."""
    text = doc.read_text() if doc.exists() else ""
    body = next((b for title, b in _split_sections(text)[1] if title == SECTION), "")
    start = body.find(READING)
    return body[start:].strip() if start >= 0 else f"{READING}\n\n_Not written yet._"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=9, help="single-request rounds")
    ap.add_argument("--no-agg", action="store_true", help="skip the agg pair")
    ap.add_argument("--rate", type=float, help=f"workload (a) rate (default {KNEE_RATE})")
    ap.add_argument("--num-requests", type=int, default=20, help="workload (a), per round")
    ap.add_argument("--rounds", type=int, default=2, help="workload (a) rounds per runtime")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    reps, n, rounds = (2, 6, 1) if args.quick else (args.reps, args.num_requests, args.rounds)
    # --quick: workload (a)'s lengths / 4, so its rate x 2 (as the goodput study's --quick)
    rate = args.rate or (2 * KNEE_RATE if args.quick else KNEE_RATE)
    slo = SLO(**json.loads((_ROOT / "docs/bench/goodput/a_slo.json").read_text())["slo"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the finally blocks run
    single_runs: dict[str, dict[str, list[Timing]]] = {}
    cpu: dict[str, dict[str, float]] = {}
    with ray_cluster(RAY_CPUS) as address:
        print(f"Ray cluster at {address}", flush=True)
        for mode in ([] if args.no_agg else ["agg"]) + ["disagg"]:
            with pair(mode, address) as servers:
                split = CpuSplit([s.server.proc.pid for s in servers.values()]).start()
                single_runs[mode] = single(servers, reps)
                cpu[mode] = split.stop()
                print(markdown_table(["setup", "TTFT ms", "TPOT ms", "Ray - local TTFT",
                                      "Ray - local TPOT"],
                                     single_rows(mode, single_runs[mode])), flush=True)
                if mode == "disagg":
                    split = CpuSplit([s.server.proc.pid for s in servers.values()]).start()
                    load_runs = under_load(servers, rate, n, rounds, slo, args.quick)
                    cpu["load"] = split.stop()
    rows = [row for mode in ("disagg", "agg") if mode in single_runs
            for row in single_rows(mode, single_runs[mode])]
    w = WORKLOADS["a"]
    cpu_text = "; ".join(f"{k}: Ray's own processes {v['ray']:.2f}, other processes "
                         f"{v['others']:.2f}" for k, v in cpu.items())
    body = [
        f"Local runtime against `--runtime ray` on a one-node Ray cluster started by the "
        f"script (`ray.cluster_utils.Cluster`, head with num_cpus={RAY_CPUS}, no dashboard) "
        "on the same 2 cores; the local and the Ray server of a mode are up at once and "
        "serve in turn (order flipped every round). Ray actors: 1 Ray CPU and one torch "
        "thread per disagg worker, unpinned; local workers pinned one core each. Agg: one "
        "worker on 2 cores (`--ray-cpus-per-worker 2`).", "",
        f"**One request at a time**: {PROMPT_TOKENS}-token prompt (random ids, no prefix "
        f"hits), {OUTPUT_TOKENS} output tokens, greedy, bf16, medians of {reps} rounds after "
        "one warm-up round; Ray - local = medians of the per-round differences and ratios.",
        "", markdown_table(["setup", "TTFT ms", "TPOT ms", "Ray - local TTFT",
                            "Ray - local TPOT"], rows), "",
        f"**Under load**: goodput study workload {w.title}"
        f"{' (lengths / 4: --quick)' if args.quick else ''}, "
        f"Poisson at {rate:g} req/s (disagg's knee in the study), {rounds} x {n} requests per "
        f"runtime (the same requests and arrival times on both), SLO TTFT <= "
        f"{slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms (the study's).", "",
        markdown_table(["runtime", "SLO attainment", "TTFT ms p50 / p90",
                        "TPOT ms p50 / p90", "failed"], load_rows(load_runs, slo)), "",
        f"CPU used on average, in cores, during each part ({cpu_text}).",
    ]
    if any(v["others"] > 0.2 for v in cpu.values()):
        body.append("Busy processes: " + "; ".join(busy_processes()[:3]))
    text = "\n".join(body)
    print(text)
    if not args.quick:
        doc = Path(args.output)
        write_section(str(doc), SECTION, text + "\n\n" + kept_reading(doc),
                      machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
