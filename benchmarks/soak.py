"""Soak under faults: minutes of streaming load on a disaggregated cluster while a fault
is injected every few seconds (workers killed and restarted, transfers corrupted or
dropped, a worker partitioned, the prefix cache silently emptied, prefills failing).

Every request's outcome is classified: completed (output identical to the offline
engine's), failed with an explicit error, lost (no answer and no error within the
deadline) or corrupted (completed with another output). Lost and corrupted must be 0.
At the end every worker's KV pool must pass its invariant check and hold nothing.

    python benchmarks/soak.py [--duration-s 180] [--rate 1.0] [--fault-every-s 12] [--quick]
                              [--layout disagg|mixed] [--log FILE]

`--layout disagg` (the default): 1 prefill + 2 decode workers, one thread each, every
prompt prefilled remotely. `--layout mixed`: what `splitserve serve` picks for long prompts
on a 2-core machine: 1 prefill + 1 decode worker under the router's conditional
disaggregation with a TPOT target, the prefill worker borrowing the decode worker's core
(helper threads on a lease) and the decode worker pacing its steps; faults then hit the
only decode worker too, whose requests wait for its restart.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from collections import Counter
from typing import Any

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, machine_description,  # noqa: E402
                          markdown_table, write_section)

# (name, role of the target, fault spec): cycled in this order.
FAULTS: list[tuple[str, str, dict[str, Any]]] = [
    ("kill a decode worker mid-sequence", "decode", {"kind": "kill", "point": "now"}),
    ("corrupt a KV transfer", "prefill", {"kind": "corrupt_kv"}),
    ("kill the prefill worker before it publishes", "prefill",
     {"kind": "kill", "point": "prefill"}),
    ("drop a KV transfer (KV never arrives)", "prefill", {"kind": "drop_kv"}),
    ("partition a decode worker (stall past the heartbeat)", "decode",
     {"kind": "stall", "point": "now", "seconds": 8.0}),
    ("empty the prefix cache silently (stale directory)", "prefill",
     {"kind": "forget_cache", "point": "now"}),
    ("fail a prefill with an error", "prefill", {"kind": "error", "point": "prefill"}),
]
# The default dtype (bf16 with the exact, batch-invariant kernels), as users run it.
COMMON = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
          "--enable-fault-injection", "--heartbeat-timeout-s", "5", "--kv-timeout-s", "5"]
# layout -> (its flags, its workers, how the section describes it)
LAYOUTS: dict[str, tuple[list[str], int, str]] = {
    "disagg": (["--mode", "disagg", "--prefill", "1", "--decode", "2", "--disagg-policy",
                "always", "--threads-per-worker", "1"], 3,
               "1 prefill + 2 decode workers (bf16, the default, one thread each, "
               "`--disagg-policy always`"),
    "mixed": (["--mode", "disagg", "--prefill", "1", "--decode", "1", "--disagg-policy",
               "auto", "--slo-tpot-ms", "100"], 2,
              "1 prefill + 1 decode worker (bf16, the default, one core each, the prefill "
              "worker borrowing the decode worker's core, `--disagg-policy auto` with "
              "`--slo-tpot-ms 100`: the router prefills some prompts on the decode worker, "
              "which paces its steps"),
}
TOPICS = ["rivers", "volcanoes", "bridges", "comets", "forests", "deserts", "glaciers",
          "islands"]
SYSTEM = " ".join(f"Rule {i}: be brief and exact." for i in range(12))


def request_pool(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    """Distinct (prompt, sampling) pairs, half sharing a long system prefix."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        prompt = f"Write {rng.randint(2, 6)} short sentences about {rng.choice(TOPICS)}."
        if i % 2:
            prompt = SYSTEM + " " + prompt
        sampling: dict[str, Any] = ({"temperature": 0.0} if i % 3 else
                                    {"temperature": 0.8, "top_p": 0.95, "seed": 7 + i})
        sampling["max_tokens"] = rng.randint(16, 64)
        pool.append((prompt, sampling))
    return pool


def references(pool: list[tuple[str, dict[str, Any]]]) -> list[str]:
    from splitserve import LLM, SamplingParams
    llm = LLM(num_threads=1, max_model_len=2048)  # the workers' dtype: the default
    return [llm.generate(p, SamplingParams(ignore_eos=True, **s))[0].text for p, s in pool]


async def soak(server: Any, args: argparse.Namespace, pool: list[tuple[str, dict[str, Any]]],
               expected: list[str]) -> dict[str, Any]:
    import openai

    from tests.faults.harness import arm, model
    rng = random.Random(args.seed)
    name = await asyncio.to_thread(model, server)
    outcomes: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    latencies: list[float] = []
    errors: list[str] = []
    timeline: list[str] = []  # what happened when, in seconds from the start (--log)

    async def one(c: openai.AsyncOpenAI, i: int) -> None:
        prompt, sampling = pool[i]
        t0 = time.monotonic()
        try:
            stream = await c.completions.create(model=name, prompt=prompt, stream=True,
                                                extra_body={"ignore_eos": True}, **sampling)
            text = "".join([ch.choices[0].text async for ch in stream if ch.choices])
        except openai.APITimeoutError:
            outcomes["lost"] += 1
            return
        except openai.APIError as exc:
            outcomes["failed"] += 1
            errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return
        latencies.append(time.monotonic() - t0)
        timeline.append(f"{t0 - start:8.2f} request {i} took {latencies[-1]:.2f} s")
        outcomes["completed" if text == expected[i] else "corrupted"] += 1

    async def inject_faults(stop_at: float) -> None:
        k = 0
        while time.monotonic() + args.fault_every_s < stop_at:
            await asyncio.sleep(args.fault_every_s)
            label, role, spec = FAULTS[k % len(FAULTS)]
            k += 1
            workers = await asyncio.to_thread(server.workers)
            targets = [w["id"] for w in workers if w["role"] == role and w["healthy"]]
            if not targets:
                continue
            target = rng.choice(targets)
            await asyncio.to_thread(arm, server, target, **spec)
            faults[label] += 1
            timeline.append(f"{time.monotonic() - start:8.2f} fault on {target}: {label}")

    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none",
                                  max_retries=0, timeout=args.request_deadline_s) as c:
        start = time.monotonic()
        stop_at = start + args.duration_s
        injector = asyncio.create_task(inject_faults(stop_at))
        tasks = []
        while time.monotonic() < stop_at:
            tasks.append(asyncio.create_task(one(c, rng.randrange(len(pool)))))
            await asyncio.sleep(rng.expovariate(args.rate))
        await injector
        done, pending = await asyncio.wait(tasks, timeout=args.request_deadline_s + 30)
        outcomes["lost"] += len(pending)
        for task in pending:
            task.cancel()
    return {"sent": len(tasks), "outcomes": outcomes, "faults": faults, "errors": errors,
            "latencies": latencies, "wall_s": time.monotonic() - start,
            "timeline": sorted(timeline)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=180.0)
    ap.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--fault-every-s", type=float, default=12.0)
    ap.add_argument("--request-deadline-s", type=float, default=240.0)
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--quick", action="store_true", help="40 s, no docs written")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="disagg")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    ap.add_argument("--log", help="write the timeline (faults, each request's E2E) and the "
                    "server's log to this file")
    args = ap.parse_args()
    if args.quick:
        args.duration_s, args.fault_every_s = 40.0, 8.0
    sys.path.insert(0, os.path.join(_ROOT, "tests"))
    from conftest import ServerProcess  # the launcher the e2e tests use

    from tests.faults.harness import assert_pools_clean, metric
    pool = request_pool(24, args.seed)
    expected = references(pool)
    flags, num_workers, described = LAYOUTS[args.layout]
    server = ServerProcess(*flags, *COMMON)
    monitor = CpuMonitor().start()
    result: dict[str, Any] = {"timeline": []}
    try:
        result = asyncio.run(soak(server, args, pool, expected))
        try:
            assert_pools_clean(server, num_workers, timeout_s=120)
            pools = "every pool passed check_invariants() and held 0 blocks, 0 requests"
        except AssertionError as exc:
            pools = f"NOT CLEAN: {exc}"
        counters = {name: metric(server, f"splitserve_{name}_total") for name in
                    ("retries", "migrations", "reprefills", "stale_routes", "fenced_messages",
                     "worker_restarts")}
    finally:
        server.stop()
        if args.log:
            with open(args.log, "w") as f:
                f.write("\n".join(result["timeline"]) + "\n\n"
                        + server.log_path.read_text(errors="replace"))
    others = monitor.stop()
    out, lat = result["outcomes"], sorted(result["latencies"])
    rows = [["requests sent", result["sent"]],
            ["faults injected", sum(result["faults"].values())],
            ["completed (output identical to the offline engine)", out["completed"]],
            ["failed with an explicit error", out["failed"]],
            ["lost (no answer, no error)", out["lost"]],
            ["corrupted (completed with another output)", out["corrupted"]]]
    rows += [[f"`splitserve_{k}_total`", f"{v:.0f}"] for k, v in counters.items()]
    if lat:
        rows.append(["E2E of completed requests, median / max",
                     f"{statistics.median(lat):.2f} s / {lat[-1]:.2f} s"])
    body = "\n".join([
        f"{args.duration_s:.0f} s of Poisson load at {args.rate} req/s (streaming, 24 distinct "
        "prompts, half sharing a system prefix, greedy and seeded sampling, 16-64 tokens) "
        f"on {described}, default `--kv-failure-policy recompute`), one fault "
        f"every {args.fault_every_s:.0f} s, "
        "cycling through the kinds below. Outputs are checked against the offline engine.", "",
        markdown_table(["", "count"], rows), "",
        "Faults injected: " + "; ".join(f"{k}: {v}" for k, v in result["faults"].items()) + ".",
        "", f"After the run: {pools}.",
        "", f"Other processes used {others:.2f} cores on average during the run.",
    ] + ([""] + ["Errors the clients saw: " + "; ".join(sorted(set(result["errors"]))[:5])]
         if result["errors"] else []))
    print(body)
    if not args.quick:
        title = "Soak under faults" + ("" if args.layout == "disagg" else f", {args.layout}")
        write_section(args.output, title, body, machine=machine_description())
    return 0 if out["lost"] == 0 and out["corrupted"] == 0 and "NOT" not in pools else 1


if __name__ == "__main__":
    sys.exit(main())
