"""`splitserve bench`: flags -> BenchConfig -> run_bench / run_sweep -> files + summary."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from splitserve.bench.config import (DISTRIBUTIONS, ENDPOINTS, SLO, WORKLOADS, BenchConfig,
                                     LengthDist)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate (a number or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"rate {text} must be > 0 (or inf)")
    return value


def _rates(text: str) -> list[float]:
    return [_rate(part) for part in text.split(",") if part.strip()]


def _spread(kind: str, spread: float) -> float:
    return spread if kind != "fixed" else 0.0


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The `splitserve bench` flags."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", help="model name (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="completions",
                   help="completions: token-id prompts (exact lengths); chat: word prompts")
    p.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    p.add_argument("--num-requests", type=int, default=100, help="requests (trace: the first N)")
    p.add_argument("--input-len", type=int, default=256, help="mean prompt tokens "
                   "(sessions: per user turn)")
    p.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="fixed",
                   help="distribution of synthetic/sessions lengths")
    p.add_argument("--output-dist", choices=DISTRIBUTIONS,
                   help="distribution of output lengths (default: --dist)")
    p.add_argument("--len-spread", type=float, default=0.5, help="uniform: +-fraction of the "
                   "mean; normal: std / mean; lognormal: sigma of log(length)")
    p.add_argument("--turns", type=int, default=4, help="sessions: turns per session")
    p.add_argument("--system-len", type=int, default=256, help="sessions: shared system prompt")
    p.add_argument("--trace", help="trace file (default ../shared/data/traces/<file>)")
    p.add_argument("--trace-jitter-s", type=float,
                   help="uniform jitter added to trace timestamps (default: mooncake 3, azure 0)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--rate", type=_rate, help="requests/s (inf: all at once; default: the "
                      "trace's timing, or inf); a trace is time-scaled to this mean rate")
    rate.add_argument("--rate-sweep", type=_rates, help="comma-separated rates, one run each")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply every length")
    p.add_argument("--time-scale", type=float, help="trace: multiply inter-arrival times")
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT target for SLO attainment")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT target for SLO attainment")
    p.add_argument("--target-attainment", type=float, default=0.9,
                   help="sweep: report the highest rate meeting this attainment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--max-model-len", type=int, help="context limit (default: the server's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--output-dir", default="bench-results")
    p.add_argument("--label", help="names the output files and plot lines (default: workload)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig the flags describe (rate: the first of a sweep's; run_sweep sets each)."""
    output_dist = args.output_dist or args.dist
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        workload=args.workload, num_requests=args.num_requests,
        input_len=LengthDist(args.dist, args.input_len, _spread(args.dist, args.len_spread)),
        output_len=LengthDist(output_dist, args.output_len,
                              _spread(output_dist, args.len_spread)), turns=args.turns,
        system_len=args.system_len, trace=args.trace, trace_jitter_s=args.trace_jitter_s,
        rate=args.rate_sweep[0] if args.rate_sweep else args.rate, burstiness=args.burstiness,
        length_scale=args.length_scale, time_scale=args.time_scale,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms), seed=args.seed,
        max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout_s,
        max_model_len=args.max_model_len, temperature=args.temperature,
        label=args.label or args.workload, show_progress=not args.no_progress)


def bench_command(args: argparse.Namespace) -> int:
    """Runs the bench the flags describe, writes `<output-dir>/<label>.json`, `.md` and
    `<label>_*.png`, prints the markdown summary; 0 once the run completed."""
    from splitserve.bench.markdown import run_markdown, sweep_markdown
    from splitserve.bench.plots import plot_attainment, plot_cdf
    from splitserve.bench.report import command_line, write_json
    from splitserve.bench.runner import run_bench, run_sweep

    if args.rate_sweep is not None and not args.rate_sweep:
        raise ValueError("--rate-sweep needs at least one rate, e.g. 1,2,4")
    config = bench_config(args)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / config.label
    if args.rate_sweep:
        sweep = run_sweep(config, args.rate_sweep, command_line())
        runs, text = sweep.runs, sweep_markdown(sweep, args.target_attainment)
        write_json(sweep, f"{base}.json")
        plot_attainment([sweep], f"{base}_attainment.png", args.target_attainment)
    else:
        report = run_bench(config, command_line())
        runs, text = [report], run_markdown(report)
        write_json(report, f"{base}.json")
    plot_cdf(runs, "ttft", f"{base}_ttft_cdf.png")
    plot_cdf(runs, "tpot", f"{base}_tpot_cdf.png")
    Path(f"{base}.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {base}.json, {base}.md and {base}_*.png", file=sys.stderr)
    return 0
