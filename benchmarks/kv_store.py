"""KV store tiers (issue 19): the engine pool alone against the same pool with a host and a
disk tier below it, same requests, one run: hit rate by tier against the infinite-cache
hit rate, mean and p90 TTFT, SLO goodput.

    python benchmarks/kv_store.py          # ~15 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/kv_store.py --quick  # ~3 min pipeline check; no doc write

One worker, colocated (`--mode agg --decode 1`); one fresh server per (workload, setup),
stopped before the next. Workloads: (t) the Mooncake conversation trace, whole
conversations drawn at random (a window of consecutive requests holds almost no reuse:
a conversation's turns are minutes apart), lengths / 16, arrivals rescaled; (s) the load
generator's multi-turn sessions. On each server: a warm-up, three cold requests of the
workload's p90 prompt (on `pool` they set the TTFT SLO and the rate), then the workload.
Hits: `usage.prompt_tokens_details.cached_tokens` (every reused prompt token), of which
`splitserve_kv_tier_hits_total{tier}` x 16 came up from a tier. The infinite-cache hit
rate is computed offline from the same prompts in arrival order.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parents[1]
for _path in (_ROOT, _ROOT / "tests"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes,  # noqa: E402
                               command_line, machine_description, now_utc, other_cpu_load,
                               write_section)
from benchmarks.goodput_study import derive_slo  # noqa: E402
from benchmarks.kv_store_doc import (SECTION, TIERS, hand_written, method,  # noqa: E402
                                     plot_hits, render)
from splitserve.bench import (SLO, BenchConfig, BenchReport, LengthDist,  # noqa: E402
                              plot_cdf, run_bench, write_json)
from splitserve.bench.arrivals import schedule  # noqa: E402
from splitserve.bench.traces import TraceRecord, read_trace  # noqa: E402
from splitserve.bench.workload import build_workload  # noqa: E402

BLOCK_TOKENS = 16
BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 2  # default model: layers x K,V x tokens x heads x dim x bf16
MAX_MODEL_LEN = 2048
POOL_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 256, 512, 8192
LOAD = 0.7  # offered load: this share of the cold capacity estimate (`calibrate`)
K_TTFT, K_TPOT = 3.0, 2.0  # the goodput study's SLO rule (derive_slo); TPOT is not targeted
RUN_INDEX = 7  # token salt of the measured requests (warm-up 1, calibration 2)
# The trace sample's window. ~130 requests drawn from the whole hour keep ~1 conversation
# in 100: so few others run between two turns that a 768-block cache keeps all the reuse.
# Drawn from 15 minutes (4x denser) more interleave, as in the trace, where the blocks
# computed between two turns far exceed a device's memory.
WINDOW_S = 900.0


@dataclass(frozen=True)
class Setup:
    name: str
    is_tiered: bool

    def flags(self, disk_dir: str) -> list[str]:
        flags = ["--mode", "agg", "--decode", "1", "--max-model-len", str(MAX_MODEL_LEN),
                 "--kv-cache-memory-bytes", str(POOL_BLOCKS * BLOCK_BYTES),
                 "--enable-prompt-tokens-details"]
        if self.is_tiered:
            flags += ["--kv-host-bytes", str(HOST_BLOCKS * BLOCK_BYTES), "--kv-disk-dir",
                      disk_dir, "--kv-disk-bytes", str(DISK_BLOCKS * BLOCK_BYTES),
                      "--kv-disk-admission", "all"]
        return flags


SETUPS = (Setup("pool", False), Setup("tiered", True))


@dataclass(frozen=True)
class Workload:
    """`bench`: BenchConfig fields; `full`/`quick`: trace requests or sessions."""
    key: str
    title: str
    bench: dict[str, Any]
    full: int
    quick: int

    def config(self, size: int, quick: bool, trace: Path) -> BenchConfig:
        fields = dict(self.bench)
        if quick:  # half lengths: the pipeline is checked, the numbers mean little
            fields["length_scale"] = fields.get("length_scale", 1.0) / 2
        if self.key == "t":
            fields.update(trace=str(trace), num_requests=size)
        else:
            fields.update(num_requests=size * fields["turns"])
        return BenchConfig(**fields, max_model_len=MAX_MODEL_LEN, run_index=RUN_INDEX,
                           request_timeout_s=300)


WORKLOADS = {w.key: w for w in (
    Workload("t", "(t) Mooncake conversations, sampled and scaled",
             dict(workload="mooncake", length_scale=1 / 16), full=120, quick=24),
    Workload("s", "(s) multi-turn sessions",
             dict(workload="sessions", turns=5, system_len=128,
                  input_len=LengthDist("uniform", 160, 0.5),
                  output_len=LengthDist("uniform", 32, 0.25)), full=16, quick=5),
)}


# -- the trace sample and offline hit rates ---------------------------------------------------
def conversations(records: Sequence[TraceRecord]) -> list[int]:
    """Each record's conversation: the index of its first turn. A record continues the
    latest earlier one it shares its longest prefix with, when that is >= 2 hash ids (the
    first id, a 512-token system prompt, is in every request). Ids are chained, so a known
    id stands for its whole prefix."""
    owner: dict[int, int] = {}  # hash id -> latest record holding it
    root: list[int] = []
    for i, rec in enumerate(records):
        n = 0
        while n < len(rec.hash_ids) and rec.hash_ids[n] in owner:
            n += 1
        root.append(root[owner[rec.hash_ids[n - 1]]] if n >= 2 else i)
        owner.update((h, i) for h in rec.hash_ids)
    return root


def sample_trace(num_requests: int, path: Path, seed: int = 0) -> list[int]:
    """Writes (Mooncake JSONL) the first `num_requests` in time of the turns within the
    first WINDOW_S of conversations drawn at random; returns their line indices."""
    records = read_trace("mooncake", None, None)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(conversations(records)):
        if records[i].timestamp_s < WINDOW_S:
            members.setdefault(r, []).append(i)
    chosen: list[int] = []
    for r in np.random.default_rng(seed).permutation(sorted(members)):
        if len(chosen) >= num_requests:
            break
        chosen += members[int(r)]
    keep = sorted(chosen)[:num_requests]
    with open(path, "w", encoding="utf-8") as f:
        for rec in (records[i] for i in keep):
            f.write(json.dumps({"timestamp": rec.timestamp_s * 1000, "input_length": rec.input_len,
                                "output_length": rec.output_len,
                                "hash_ids": list(rec.hash_ids)}) + "\n")
    return keep


def chain(prompt: Sequence[int]) -> list[int]:
    """The chained hashes of the prompt's full 16-token blocks."""
    parent, out = 0, []
    for start in range(0, len(prompt) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = hash((parent, tuple(prompt[start:start + BLOCK_TOKENS])))
        out.append(parent)
    return out


def prefix_hits(prompts: Sequence[Sequence[int]], capacity: int | None = None) -> list[int]:
    """Prompt tokens each prompt (in order) finds cached: its leading full blocks the cache
    holds, at most (len - 1) // 16 (the engine always computes the last token). `capacity`
    None: every block seen before (the infinite cache); else an LRU cache of that many
    blocks (all of a prompt's blocks are touched after its lookup)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = []
    for prompt in prompts:
        hashes, limit, n = chain(prompt), (len(prompt) - 1) // BLOCK_TOKENS, 0
        while n < limit and hashes[n] in cache:
            n += 1
        hits.append(n * BLOCK_TOKENS)
        for h in hashes:
            cache[h] = None
            cache.move_to_end(h)
            if capacity is not None and len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def offline(config: BenchConfig) -> dict[str, Any]:
    """The workload as it will be sent, and the hit rates of caches of a few sizes."""
    built = build_workload(config, MAX_MODEL_LEN)
    arrivals, _ = schedule(dataclasses.replace(config, rate=1.0), built)  # the order only
    prompts = [built.requests[i].prompt_token_ids
               for i in sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i))]
    total, lens = sum(len(p) for p in prompts), [len(p) for p in prompts]
    sizes = {"infinite": None, "lru_pool": POOL_BLOCKS, "lru_pool_host": POOL_BLOCKS + HOST_BLOCKS}
    outs = [r.output_len for r in built.requests]
    return {"info": dataclasses.asdict(built.info), "prompt_tokens": total,
            "rates": {k: sum(prefix_hits(prompts, cap)) / total for k, cap in sizes.items()},
            "unique_blocks": len({h for p in prompts for h in chain(p)}),
            "p90_prompt": int(np.percentile(lens, 90, method="higher")),
            "mean_prompt": float(np.mean(lens)), "mean_output": float(np.mean(outs)),
            "median_output": max(2, round(statistics.median(outs)))}


# -- servers and runs -----------------------------------------------------------------------------
def wait_quiet(max_s: float) -> float:
    """Waits (up to `max_s`) until other processes use < 0.15 cores over 5 s: on a shared
    2-core machine a setup started during someone's build or test run measures them."""
    deadline = time.monotonic() + max_s
    while (load := other_cpu_load(5.0)) >= 0.15 and time.monotonic() < deadline:
        print(f"  waiting for a quiet machine: others use {load:.2f} cores "
              f"{busy_processes()[:2]}", flush=True)
        time.sleep(20.0)
    return load


@contextlib.contextmanager
def serving(setup: Setup, work: Path) -> Iterator[Any]:
    """`splitserve serve` for `setup` (a fresh disk directory), stopped with SIGTERM."""
    from conftest import ServerProcess

    flags = setup.flags(tempfile.mkdtemp(prefix=f"{setup.name}-", dir=work))
    print(f"  starting {setup.name}: splitserve serve {' '.join(flags)}", flush=True)
    server = ServerProcess(*flags)
    try:
        yield server
    finally:
        server.stop()


def calibrate(url: str, w: dict[str, Any]) -> dict[str, Any]:
    """Unloaded TTFT and TPOT of three cold requests of the workload's p90 prompt and median
    output. On `pool` they give the SLO (derive_slo's TTFT; no TPOT target: colocated on 2
    cores, every prefill chunk next to a decode stalls it for the whole step, so 2 x the
    unloaded TPOT is missed by both setups alike) and the rate: LOAD / the cold service
    time of a mean request (the TTFT scaled to the mean prompt, plus its decode at the
    unloaded TPOT: the small pool runs few sequences at once, so decode batches little)."""
    cfg = BenchConfig(base_url=url, input_len=LengthDist("fixed", w["p90_prompt"]),
                      output_len=LengthDist("fixed", w["median_output"]), num_requests=3,
                      max_concurrency=1, rate=math.inf, run_index=2, label="calibrate",
                      max_model_len=MAX_MODEL_LEN)
    m = run_bench(cfg).metrics
    assert m.ttft_ms.median is not None and m.tpot_ms.median is not None, m.errors
    ttft0, tpot0 = m.ttft_ms.median / 1e3, m.tpot_ms.median / 1e3
    service = ttft0 * w["mean_prompt"] / w["p90_prompt"] + w["mean_output"] * tpot0
    slo = SLO(ttft_ms=derive_slo(ttft0, tpot0, K_TTFT, K_TPOT).ttft_ms)
    return {"ttft0_ms": ttft0 * 1e3, "tpot0_ms": tpot0 * 1e3, "service_s": service,
            "rate": float(f"{LOAD / service:.3g}"), "slo": dataclasses.asdict(slo)}


def tier_counters(report: BenchReport) -> dict[str, dict[str, float]]:
    """splitserve_kv_tier_* counter changes over the run: name -> tier[/reason] -> value."""
    out: dict[str, dict[str, float]] = {}
    for c in report.server_breakdown.counters if report.server_breakdown else []:
        if c.name.startswith("splitserve_kv_tier_"):
            key = "/".join(c.labels[k] for k in ("tier", "reason") if k in c.labels)
            name = c.name.removeprefix("splitserve_kv_tier_").removesuffix("_total")
            out.setdefault(name, {})[key] = out.get(name, {}).get(key, 0.0) + c.value
    return out


def summarize(report: BenchReport, w: dict[str, Any], cpu: float,
              restarts: float) -> dict[str, Any]:
    m, done = report.metrics, [r for r in report.records if r.is_completed]
    sent = sum(r.prompt_len for r in report.records)
    cached = sum(r.cached_tokens or 0 for r in done)
    tiers = tier_counters(report)
    up = {t: tiers.get("hits", {}).get(t, 0.0) * BLOCK_TOKENS for t in TIERS}
    hit = {"device": (cached - sum(up.values())) / sent, **{t: v / sent for t, v in up.items()},
           "total": cached / sent}
    b = report.server_breakdown
    return {"setup": report.label, "hit": hit, "vs_infinite": hit["total"] / w["rates"]["infinite"]
            if w["rates"]["infinite"] else None, "cached_tokens": cached, "sent_tokens": sent,
            "server_hit_tokens": sum(c.value for c in b.counters_of(
                "splitserve_prefix_cache_hit_tokens")) if b else None, "tiers": tiers,
            "ttft_mean_ms": m.ttft_ms.mean, "ttft_p90_ms": m.ttft_ms.p90,
            "ttft_median_ms": m.ttft_ms.median, "tpot_p90_ms": m.tpot_ms.p90,
            "tpot_median_ms": m.tpot_ms.median,
            "attainment": m.slo_attainment, "goodput": m.goodput, "duration_s": m.duration_s,
            "failed": m.num_failed, "rate": report.arrivals.rate,
            "mean_rate": report.arrivals.mean_rate, "other_cpu_cores": cpu, "restarts": restarts}


def run_workload(key: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Both setups on one workload; returns its results (also `<key>.json`)."""
    spec = WORKLOADS[key]
    size = args.size.get(key) or (spec.quick if args.quick else spec.full)
    trace = work / "mooncake_sample.jsonl"
    lines = sample_trace(size, trace) if key == "t" else None
    config = spec.config(size, args.quick, trace)
    w, calib, runs, rows = offline(config), dict[str, dict[str, Any]](), [], []
    r = w["rates"]
    print(f"{spec.title}: {w['info']['description']}; {w['info']['num_requests']} requests, "
          f"{w['prompt_tokens']} prompt tokens, {w['unique_blocks']} distinct blocks; hit rate "
          f"infinite {r['infinite']:.1%}, LRU {POOL_BLOCKS} blocks {r['lru_pool']:.1%}, LRU "
          f"{POOL_BLOCKS + HOST_BLOCKS} {r['lru_pool_host']:.1%}", flush=True)
    for setup in SETUPS:
        quiet_before = wait_quiet(args.max_wait_s)
        monitor = CpuMonitor().start()
        with serving(setup, work) as server:
            run_bench(BenchConfig(base_url=server.url, num_requests=2, rate=math.inf,
                                  input_len=LengthDist("fixed", 64), run_index=1,
                                  output_len=LengthDist("fixed", 4), label="warmup"))
            calib[setup.name] = c = calibrate(server.url, w)
            base = calib[SETUPS[0].name]
            print(f"  cold p90 prompt ({w['p90_prompt']} tokens): TTFT {c['ttft0_ms']:.0f} ms, "
                  f"TPOT {c['tpot0_ms']:.1f} ms; SLO {base['slo']}, rate {base['rate']:g} req/s",
                  flush=True)
            t0 = time.monotonic()
            run = run_bench(dataclasses.replace(config, base_url=server.url, label=setup.name,
                                                rate=args.rate or base["rate"],
                                                slo=SLO(**base["slo"])), command_line())
            restarts = server.restarts()
        row = {**summarize(run, w, monitor.stop(), restarts), "quiet_before": quiet_before}
        runs.append(run)
        rows.append(row)
        write_json(run, args.out / f"{key}_{setup.name}.json")
        h = row["hit"]
        print(f"  [{key}/{setup.name}] hit {h['total']:.1%} (device {h['device']:.1%}, host "
              f"{h['host']:.1%}, disk {h['disk']:.1%}) = {row['vs_infinite']:.0%} of infinite; "
              f"TTFT mean {row['ttft_mean_ms']:.0f} / p90 {row['ttft_p90_ms']:.0f} ms; attainment"
              f" {row['attainment']:.0%}, goodput {row['goodput']:.3f} req/s; failed "
              f"{row['failed']}; restarts {restarts:g}; {time.monotonic() - t0:.0f} s", flush=True)
    plot_cdf(runs, "ttft", args.out / f"{key}_ttft_cdf.png")
    return {"key": key, "title": spec.title, "offline": w, "calibration": calib, "rows": rows,
            "trace_lines": lines, "date": now_utc(), "command": command_line()}


def settings() -> dict[str, Any]:
    """The constants the doc section names."""
    return {"block_bytes": BLOCK_BYTES, "max_model_len": MAX_MODEL_LEN, "load": LOAD,
            "pool_blocks": POOL_BLOCKS, "host_blocks": HOST_BLOCKS, "disk_blocks": DISK_BLOCKS,
            "k_ttft": K_TTFT, "k_tpot": K_TPOT, "window_s": WINDOW_S}


def code_state() -> str:
    """The commit, and the server code's uncommitted files (others edit the same tree)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=_ROOT, capture_output=True, text=True).stdout
    dirty = [p for p in git("status", "--short", "--", "splitserve").split() if "/" in p]
    return f"code: commit {git('rev-parse', '--short', 'HEAD').strip()}" + (
        f" + uncommitted {', '.join(dirty)}" if dirty else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small workloads; no doc write")
    ap.add_argument("--workloads", default="t,s", help=f"of {','.join(WORKLOADS)}")
    ap.add_argument("--trace-requests", type=int, help="(t) requests")
    ap.add_argument("--sessions", type=int, help="(s) sessions")
    ap.add_argument("--rate", type=float, help="req/s instead of the calibrated one")
    ap.add_argument("--max-wait-s", type=float, default=600.0,
                    help="before each server, wait this long at most for a quiet machine")
    ap.add_argument("--out", type=Path, help="JSON and PNG directory (default docs/bench/"
                    "kv_store, or /tmp/kv_store_quick with --quick)")
    ap.add_argument("--doc", default=_ROOT / DEFAULT_OUTPUT, type=Path)
    args = ap.parse_args()
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    if not keys or any(k not in WORKLOADS for k in keys):
        ap.error(f"--workloads {args.workloads!r}: use some of {','.join(WORKLOADS)}")
    args.size = {"t": args.trace_requests, "s": args.sessions}
    args.out = (args.out or (Path("/tmp/kv_store_quick") if args.quick
                             else _ROOT / "docs/bench/kv_store")).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    busy = other_cpu_load(2.0)
    quiet = {"other_cpu_cores": busy, "busy": busy_processes()[:3], "code": code_state()}
    print(f"kv store benchmark: other processes use {busy:.2f} cores {quiet['busy']}; "
          f"{quiet['code']}", flush=True)
    if busy > 0.1:
        print("WARNING: the machine is busy; latencies will be noise", flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kv-store-bench-") as tmp:
        results = [run_workload(k, args, Path(tmp)) for k in keys]
    for res in results:
        res["settings"], res["quiet"] = settings(), quiet
        (args.out / f"{res['key']}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot_hits(results, args.out / "hits.png")
    doc_dir = args.doc.resolve().parent
    plots = args.out.relative_to(doc_dir) if args.out.is_relative_to(doc_dir) else args.out
    body = "\n\n".join([method(quiet, settings()), *(render(r, r["settings"], plots)
                                                          for r in results),
                        hand_written(args.doc)])
    if args.quick:
        (args.out / "section.md").write_text(body + "\n")
        print(body + f"\n\n(--quick: not written to {args.doc}; see {args.out / 'section.md'})")
    else:
        write_section(str(args.doc), SECTION, body, machine=machine_description())
        print(body + f"\n\nwrote the {SECTION!r} section of {args.doc}")
    print(f"done in {(time.monotonic() - t0) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
