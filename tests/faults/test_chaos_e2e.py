"""Chaos: concurrent streaming requests while workers are killed (and restarted) and KV
transfers are corrupted at random, from a seeded schedule. Afterwards every request has
completed with exactly the offline engine's output: zero failed, zero hung, zero
corrupted, zero leaked blocks. Recovery absorbs the whole schedule (retries, migrations,
waits for restarted workers) instead of giving requests up. Workers and the offline
reference run the default dtype (bf16) with the exact kernels (one thread per worker, two
offline), so "exactly" means bit for bit, greedy and seeded, after retries and
migrations."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import openai
import pytest

from splitserve import LLM, SamplingParams
from tests.faults.harness import FLAGS, arm, assert_pools_clean, metric, model, wait_healthy

SEED = 20261122
NUM_REQUESTS = 12
NUM_KILLS = 3
NUM_WORKERS = 3
HANG_DEADLINE_S = 240.0


def workload(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    topics = ["rivers", "volcanoes", "bridges", "comets", "forests", "deserts"]
    out = []
    for i in range(NUM_REQUESTS):
        prompt = f"Write {rng.randint(3, 6)} short sentences about {rng.choice(topics)}."
        sampling: dict[str, Any] = ({"temperature": 0.0} if i % 2 else
                                    {"temperature": 0.8, "top_p": 0.95, "seed": 100 + i})
        sampling["max_tokens"] = rng.randint(24, 64)
        out.append((prompt, sampling))
    return out


@pytest.fixture(scope="module")
def chaos_cluster(start_server: Any) -> Any:
    return start_server("--mode", "disagg", "--prefill", "1", "--decode", "2",
                        "--disagg-policy", "always", "--kv-failure-policy", "retry",
                        "--max-retries", "4", "--heartbeat-timeout-s", "5", *FLAGS)


def test_chaos(chaos_cluster: Any) -> None:
    rng = random.Random(SEED)
    requests = workload(rng)
    llm = LLM(num_threads=2, max_model_len=2048)
    reference = [llm.generate(p, SamplingParams(ignore_eos=True, **s))[0].text
                 for p, s in requests]
    name = model(chaos_cluster)
    arm(chaos_cluster, "prefill-0", kind="corrupt_kv", probability=0.3, count=0, seed=SEED)

    async def one(i: int, c: openai.AsyncOpenAI) -> tuple[str, str]:
        await asyncio.sleep(rng.uniform(0, 3))
        prompt, sampling = requests[i]
        try:
            stream = await c.completions.create(model=name, prompt=prompt, stream=True,
                                                extra_body={"ignore_eos": True}, **sampling)
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        except openai.APIError as exc:  # reported below: recovery gave the request up
            return "failed", f"{type(exc).__name__}: {exc}"
        return ("completed" if text == reference[i] else "corrupted"), text

    async def chaos() -> int:
        kills = 0
        for _ in range(NUM_KILLS):
            await asyncio.sleep(rng.uniform(0.5, 2.5))
            workers = await asyncio.to_thread(chaos_cluster.workers)
            alive = [w["id"] for w in workers if w["healthy"]]
            if alive:
                await asyncio.to_thread(arm, chaos_cluster, rng.choice(alive), kind="kill",
                                        point="now")
                kills += 1
        return kills

    async def main() -> tuple[list[Any], int]:
        async with openai.AsyncOpenAI(base_url=chaos_cluster.url + "/v1", api_key="none",
                                      max_retries=0, timeout=HANG_DEADLINE_S) as c:
            tasks = [asyncio.create_task(one(i, c)) for i in range(NUM_REQUESTS)]
            kills = await chaos()
            done, pending = await asyncio.wait(tasks, timeout=HANG_DEADLINE_S)
            for task in pending:
                task.cancel()
            return [t.result() if t in done else ("hung", "") for t in tasks], kills

    start = time.monotonic()
    results, kills = asyncio.run(main())
    counts = {k: sum(1 for r, _ in results if r == k)
              for k in ("completed", "failed", "hung", "corrupted")}
    corrupted = metric(chaos_cluster, "splitserve_kv_transfers_total", side="receiver",
                       outcome="ChecksumMismatch")
    wait_healthy(chaos_cluster, NUM_WORKERS)
    leaked = "none"
    try:
        assert_pools_clean(chaos_cluster, NUM_WORKERS)
    except AssertionError as exc:
        leaked = str(exc)
    print(f"\nchaos: {NUM_REQUESTS} requests, {kills} workers killed, {corrupted:.0f} "
          f"transfers corrupted, {metric(chaos_cluster, 'splitserve_retries_total'):.0f} "
          f"retries, {metric(chaos_cluster, 'splitserve_migrations_total'):.0f} migrations; "
          f"completed {counts['completed']}, failed with an error {counts['failed']}, "
          f"hung {counts['hung']}, corrupted {counts['corrupted']}, leaked blocks: {leaked} "
          f"({time.monotonic() - start:.0f} s)")
    for (outcome, detail), (prompt, sampling) in zip(results, requests):
        if outcome != "completed":
            print(f"  {outcome}: {prompt!r} {sampling}: {detail!r}")
    assert counts["completed"] == NUM_REQUESTS, results
    assert leaked == "none", leaked
