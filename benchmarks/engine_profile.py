"""`python benchmarks/engine.py --profile`: where a prefill, a batch-1 and a batch-32 decode step
spend their time (torch.profiler op tables and cProfile of the Python side)."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from common import median  # noqa: E402
from engine_measure import (BATCH, DECODE_PROMPT_LEN, PREFILL_LEN, _ids,  # noqa: E402
                            engine_decode, engine_prefill, greedy, random_prompts)

from splitserve.engine.engine import LLMEngine  # noqa: E402


def _profile_step(engine: LLMEngine, title: str, log, rows: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    ops_us = sum(e.self_cpu_time_total for e in events)
    log(f"\n=== {title}: step {wall * 1e3:.2f} ms under the profiler; self time in torch ops "
        f"{ops_us / 1e3:.2f} ms, the rest ({max(0.0, wall * 1e3 - ops_us / 1e3):.2f} ms) is "
        "the exact kernels (not torch ops), Python (scheduler, runner, modules) and profiler "
        "overhead")
    log(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    log(f"--- {title}: by input shape (top 10)")
    log(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=28,
        max_shapes_column_width=60))


def _cprofile_step(engine: LLMEngine, title: str, log, rows: int = 15) -> None:
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    engine.step()
    pr.disable()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(rows)
    log(f"\n=== {title} (cProfile, {wall * 1e3:.2f} ms, by own time)")
    log("\n".join(s.getvalue().splitlines()[4:]))


def profile(engine: LLMEngine, log) -> None:
    """What each figure spends its time on: a 512-token prefill step, a batch-1 decode step,
    a batch-32 decode step (torch.profiler op table + cProfile of the Python side)."""
    vocab = engine.spec.vocab_size
    for _ in range(2):  # warm-up
        engine_prefill(engine, random_prompts(1, PREFILL_LEN, vocab)[0])
        engine_decode(engine, random_prompts(1, DECODE_PROMPT_LEN, vocab), 8)

    # Untimed-wall reference, no profiler: what the steps cost normally.
    def plain_step_ms(prompts: list[list[int]], n_steps: int) -> tuple[float, float]:
        ids = [f"p-{next(_ids)}" for _ in prompts]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, greedy(64))
        t0 = time.perf_counter()
        engine.step()
        t_prefill = time.perf_counter() - t0
        times = []
        for _ in range(n_steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        for rid in ids:
            engine.abort(rid)
        return t_prefill * 1e3, median(times) * 1e3

    _, b1_ms = plain_step_ms(random_prompts(1, DECODE_PROMPT_LEN, vocab), 20)
    p_ms, _ = plain_step_ms(random_prompts(1, PREFILL_LEN, vocab), 1)
    log(f"without profiler: 512-token prefill step {p_ms:.1f} ms ({PREFILL_LEN / p_ms * 1e3:.0f} "
        f"tok/s); batch-1 decode step {b1_ms:.2f} ms ({1e3 / b1_ms:.1f} tok/s)")

    engine.add_request(f"p-{next(_ids)}", random_prompts(1, PREFILL_LEN, vocab)[0], greedy(1))
    _profile_step(engine, f"prefill, one {PREFILL_LEN}-token prompt", log)
    while engine.has_unfinished:
        engine.step()

    rid = f"p-{next(_ids)}"
    engine.add_request(rid, random_prompts(1, DECODE_PROMPT_LEN, vocab)[0], greedy(64))
    for _ in range(6):  # prefill + a few decode steps
        engine.step()
    _profile_step(engine, "decode, batch 1", log)
    _cprofile_step(engine, "decode, batch 1", log)
    engine.abort(rid)

    ids = [f"p-{next(_ids)}" for _ in range(BATCH)]
    for r, p in zip(ids, random_prompts(BATCH, DECODE_PROMPT_LEN, vocab)):
        engine.add_request(r, p, greedy(64))
    for _ in range(4):
        engine.step()
    t0 = time.perf_counter()
    engine.step()
    log(f"\nwithout profiler: batch-{BATCH} decode step {(time.perf_counter() - t0) * 1e3:.1f} ms")
    _profile_step(engine, f"decode, batch {BATCH}", log)
    _cprofile_step(engine, f"decode, batch {BATCH}", log)
    for r in ids:
        engine.abort(r)
