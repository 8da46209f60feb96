"""Head-of-line blocking in chunked prefill: the TTFT of short prompts that arrive while a
long one is being prefilled, at `max_num_partial_prefills` 1 (first come, first served:
vLLM-v1's schedule and ours before 2026-11-25), 2 (the default) and 4, and at 2 with
`max_step_ms` 1000 (what `splitserve serve` runs: no step longer than a second at the
engine's measured speed, so a prompt arriving mid-step waits less on a slow CPU).

    python benchmarks/prefill_sharing.py          # ~5 min on 2 cores (AVX2),
                                                    writes docs/benchmarks.md
    python benchmarks/prefill_sharing.py --quick  # short prompts, no doc

One engine (default model, bf16, 512-token step budget) on one core, as a prefill worker
runs. The scenario is goodput table (c)'s misses under the mixed layout (2026-11-25
02:40): the trace's 4071-token prompt, then prompts of 589, 395 and 709 tokens arriving
1, 2 and 3 s after it. Arrivals are wall-clock: before each step the prompts whose time
has come are added. Each prompt asks for one token (a prefill worker's job), so its TTFT
is arrival -> the step that samples it. Rounds interleave the settings; the table gives
each figure's median over rounds. Outputs are compared across settings too: a schedule
must never change a token.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from statistics import median

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.common import (DEFAULT_OUTPUT, busy_processes, machine_description,  # noqa: E402
                               markdown_table, other_cpu_load, write_section)
from splitserve.config import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402

# (max_num_partial_prefills, max_step_ms)
SETTINGS: tuple[tuple[int, float | None], ...] = ((1, None), (2, None), (4, None), (2, 1000.0))
# (name, prompt tokens, arrival s after the first)
SCENARIO = (("long", 4071, 0.0), ("short-1", 589, 1.0), ("short-2", 395, 2.0),
            ("short-3", 709, 3.0))
QUICK = (("long", 600, 0.0), ("short-1", 90, 0.2), ("short-2", 60, 0.4), ("short-3", 110, 0.6))


def run_once(engine: LLMEngine, prompts: dict[str, list[int]],
             scenario: tuple[tuple[str, int, float], ...]) -> tuple[dict[str, float],
                                                                    dict[str, list[int]], float]:
    """One replay: (TTFT s per prompt, its token, makespan s)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    pending = sorted(scenario, key=lambda s: s[2])
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while pending or engine.has_unfinished:
        now = time.perf_counter() - start
        while pending and pending[0][2] <= now:
            name, _, _ = pending.pop(0)
            engine.add_request(name, prompts[name], params)
        if not engine.has_unfinished:
            time.sleep(min(0.01, max(0.0, pending[0][2] - now)))
            continue
        for out in engine.step():
            if out.finished:
                arrival = next(s[2] for s in scenario if s[0] == out.request_id)
                ttft[out.request_id] = time.perf_counter() - start - arrival
                tokens[out.request_id] = list(out.token_ids)
    return ttft, tokens, time.perf_counter() - start


def label(setting: tuple[int, float | None]) -> str:
    n, ms = setting
    text = f"max_num_partial_prefills {n}" + (" (FCFS)" if n == 1 else "")
    return text + (f", max_step_ms {ms:g} (serve's default)" if ms is not None else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--output", default=os.path.join(_ROOT, DEFAULT_OUTPUT))
    args = ap.parse_args()
    scenario = QUICK if args.quick else SCENARIO
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: a prefill worker's
    engines = {(n, ms): LLMEngine(EngineConfig.from_kwargs(
        num_threads=1, max_num_partial_prefills=n, max_step_ms=ms, enable_prefix_caching=False))
        for n, ms in SETTINGS}
    rng = random.Random(0)
    vocab = next(iter(engines.values())).spec.vocab_size
    prompts = {name: [rng.randrange(256, vocab) for _ in range(n)] for name, n, _ in scenario}
    load = other_cpu_load()
    results: dict[tuple[int, float | None], list[tuple[dict[str, float], float]]] = {
        setting: [] for setting in SETTINGS}
    reference: dict[str, list[int]] | None = None
    for engine in engines.values():  # warm-up (and a time budget's first measured steps)
        run_once(engine, {k: v[:64] for k, v in prompts.items()}, QUICK)
    for r in range(args.rounds):
        for setting in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            ttft, tokens, makespan = run_once(engines[setting], prompts, scenario)
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit(f"{label(setting)} changed an output: "
                                 f"{tokens} vs {reference}")
            results[setting].append((ttft, makespan))
            print(f"round {r} {label(setting)}: " + ", ".join(
                f"{k} {v:.1f}s" for k, v in ttft.items()) + f"; all done {makespan:.1f}s",
                flush=True)
    names = [name for name, _, _ in scenario]
    shorts = [name for name in names if name != "long"]
    base = median(max(t[s] for s in shorts) for t, _ in results[SETTINGS[0]])
    rows = []
    for setting in SETTINGS:
        per = {name: median(t[name] for t, _ in results[setting]) for name in names}
        worst = median(max(t[s] for s in shorts) for t, _ in results[setting])
        rows.append([label(setting), *(f"{per[name]:.1f}" for name in names),
                     f"{worst:.1f} ({worst / base:.2f}x)",
                     f"{median(m for _, m in results[setting]):.1f}"])
    header = ["setting",
              *(f"{name} ({n} tok) TTFT s" for name, n, _ in scenario),
              "worst short TTFT s (vs FCFS)", "all done s"]
    body = "\n".join([
        f"One engine on one core (bf16, 512-token steps, no prefix cache), prompts arriving "
        f"at {', '.join(f'{a:g} s' for *_, a in scenario)}; median of {args.rounds} rounds "
        f"per setting, interleaved; every setting gave the same tokens. Other CPU load at "
        f"start: {load:.2f} cores{'; busy: ' + ', '.join(busy_processes()) if load > 0.2 else ''}.",
        "", markdown_table(header, rows)])
    print(body)
    if not args.quick:
        write_section(args.output, "Prefill sharing: short prompts behind a long one", body,
                      machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
