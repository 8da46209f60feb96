"""Serving overhead: TTFT and TPOT of one request through `splitserve serve` (disagg and
agg) against the offline engine on the same prompt, measured in one run.

    python bench/serving.py            # ~3 min on 2 cores; writes docs/benchmarks.md
    python bench/serving.py --quick    # 2 repetitions, no doc

One streaming completion at a time (the openai client, real HTTP, SSE), a 512-token prompt
of random token ids (fresh per repetition, so no prefix-cache hits), 64 output tokens
(ignore_eos), greedy, bf16. TTFT = request sent -> first chunk; TPOT = (E2E - TTFT) /
(tokens - 1). Baselines run the engine alone in a process pinned like the workers:
disagg workers get one core and one thread each, so its baseline is the engine on one
core; the agg worker gets both cores, so its baseline is the engine on two.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from bench.common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes,  # noqa: E402
                          machine_description, markdown_table, median, write_section)

PROMPT_TOKENS, OUTPUT_TOKENS = 512, 64


def prompt_ids(rep: int) -> list[int]:
    rng = random.Random(1000 + rep)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


def offline(reps: int, threads: int, cores: list[int]) -> dict[str, list[float]]:
    """The engine alone, in a child process pinned to `cores`."""
    code = f"""
import json, os, time, sys
sys.path.insert(0, {_ROOT!r})
os.sched_setaffinity(0, {cores!r})
from bench.serving import prompt_ids, OUTPUT_TOKENS
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig.from_kwargs(num_threads={threads}, max_model_len=2048))
params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
ttft, tpot = [], []
for rep in range(-1, {reps}):
    t0 = time.perf_counter()
    engine.add_request(f"r{{rep}}", prompt_ids(rep + 100), params)
    first = None
    while engine.has_unfinished:
        for out in engine.step():
            if first is None and out.token_ids:
                first = time.perf_counter()
    end = time.perf_counter()
    if rep >= 0:
        ttft.append(first - t0)
        tpot.append((end - first) / (OUTPUT_TOKENS - 1))
print(json.dumps({{"ttft": ttft, "tpot": tpot}}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if res.returncode != 0:
        raise RuntimeError(res.stderr[-3000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def served(reps: int, flags: list[str]) -> dict[str, list[float]]:
    import openai
    sys.path.insert(0, os.path.join(_ROOT, "tests"))
    from conftest import ServerProcess  # the same launcher the e2e tests use
    server = ServerProcess(*flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        model = client.models.list().data[0].id
        ttft, tpot = [], []
        for rep in range(-1, reps):
            t0 = time.perf_counter()
            first, num = None, 0
            for chunk in client.completions.create(
                    model=model, prompt=prompt_ids(rep + 100), max_tokens=OUTPUT_TOKENS,
                    temperature=0, stream=True, extra_body={"ignore_eos": True}):
                if first is None:
                    first = time.perf_counter()
                num += 1 if chunk.choices else 0
            end = time.perf_counter()
            if rep >= 0 and first is not None:
                ttft.append(first - t0)
                tpot.append((end - first) / (OUTPUT_TOKENS - 1))
        return {"ttft": ttft, "tpot": tpot}
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    args = ap.parse_args()
    reps = 2 if args.quick else args.reps
    monitor = CpuMonitor().start()
    runs = {
        "engine, 1 core": offline(reps, 1, [1]),
        "disagg (1 prefill + 1 decode, 1 core each)": served(
            reps, ["--mode", "disagg", "--disagg-policy", "always", "--max-model-len", "2048"]),
        "engine, 2 cores": offline(reps, 2, [0, 1]),
        "agg (1 worker, 2 cores)": served(reps, ["--mode", "agg", "--max-model-len", "2048"]),
    }
    others = monitor.stop()
    base = {"disagg (1 prefill + 1 decode, 1 core each)": "engine, 1 core",
            "agg (1 worker, 2 cores)": "engine, 2 cores"}
    rows = []
    for name, run in runs.items():
        ttft, tpot = median(run["ttft"]) * 1000, median(run["tpot"]) * 1000
        ref = base.get(name)
        if ref is None:
            rows.append([name, f"{ttft:.1f}", f"{tpot:.2f}", "-", "-"])
        else:
            r_ttft, r_tpot = median(runs[ref]["ttft"]) * 1000, median(runs[ref]["tpot"]) * 1000
            rows.append([name, f"{ttft:.1f}", f"{tpot:.2f}", f"{ttft - r_ttft:+.1f} ms "
                         f"({ttft / r_ttft:.2f}x)", f"{tpot - r_tpot:+.2f} ms ({tpot / r_tpot:.2f}x)"])
    body = [
        f"One streaming request at a time: {PROMPT_TOKENS}-token prompt (random ids, no "
        f"prefix hits), {OUTPUT_TOKENS} output tokens, greedy, bf16, medians of {reps} "
        "repetitions after one warm-up. Served = `splitserve serve` + openai client over "
        "HTTP/SSE; disagg uses `--disagg-policy always` (every request: prefill worker -> "
        "KV transfer over TCP -> decode worker). Overhead = served minus the engine alone "
        "on the same cores.", "",
        markdown_table(["setup", "TTFT ms", "TPOT ms", "TTFT overhead", "TPOT overhead"],
                       rows), "",
        f"Other processes used {others:.2f} cores on average during the run.",
    ]
    busy = busy_processes()
    if busy and others > 0.2:
        body.append("Busy processes: " + "; ".join(busy[:3]))
    text = "\n".join(body)
    print(text)
    if not args.quick:
        write_section(args.output, "Serving overhead", text, machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
