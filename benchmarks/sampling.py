"""What sampling costs a decode step: a batch of 1, 8 and 32 sequences decoding with
temperature 1 (sampled) against greedy on the same engine, with the sampler the engine runs
(an inverse-CDF draw per row, engine/sampler.py) and the one it replaced on 2026-11-27 (an
exponential race: 49,152 exponentials drawn per row), rounds interleaved.

    python benchmarks/sampling.py           # ~3 min on 2 cores (AVX2); writes docs/benchmarks.md
    python benchmarks/sampling.py --quick   # fewer steps, no doc

The default model, bf16, 2 threads; each sequence has a 32-token prompt and decodes until
the batch's steps are measured (ignore_eos). A figure is the median step time over the
measured steps of every round.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from statistics import median

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.common import (DEFAULT_OUTPUT, machine_description, markdown_table,  # noqa: E402
                               other_cpu_load, write_section)
from splitserve.config import EngineConfig  # noqa: E402
from splitserve.engine import sampler  # noqa: E402
from splitserve.engine.batch import SampleSpec  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.engine.sampling_params import SamplingParams  # noqa: E402

BATCHES = (1, 8, 32)


def exponential_race(logits: torch.Tensor, spec: SampleSpec) -> int:
    """The sampler before 2026-11-27: argmax(p / E), E ~ Exp(1) per token (the baseline)."""
    p = spec.params
    if p.is_greedy:
        return int(logits.argmax())
    probs = sampler.filter_probs(torch.softmax(logits / p.temperature, dim=-1),
                                 p.top_k, p.top_p, p.min_p)
    gen = torch.Generator(device="cpu").manual_seed(
        sampler.position_seed(spec.seed, spec.output_pos))
    noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=gen)
    return int((probs.cpu() / noise).argmax())


SAMPLERS: dict[str, Callable[[torch.Tensor, SampleSpec], int]] = {
    "inverse CDF (now)": sampler.sample_one, "exponential race (before)": exponential_race}


@contextmanager
def using(sample_one: Callable[[torch.Tensor, SampleSpec], int]) -> Iterator[None]:
    saved = sampler.sample_one
    sampler.sample_one = sample_one  # type: ignore[assignment]  # sample() looks it up
    try:
        yield
    finally:
        sampler.sample_one = saved


def step_times(engine: LLMEngine, batch: int, temperature: float, steps: int) -> list[float]:
    """Seconds per step of `batch` sequences decoding (after their prefill)."""
    params = SamplingParams(temperature=temperature, max_tokens=None, ignore_eos=True)
    ids = [f"b{batch}-t{temperature}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [1] + [100 + i] * 31, params)
    while engine.load().num_waiting or engine.load().num_prefilling:
        engine.step()
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort(rid)
    return times[2:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output", default=os.path.join(_ROOT, DEFAULT_OUTPUT))
    args = ap.parse_args()
    steps = 4 if args.quick else 12
    engine = LLMEngine(EngineConfig.from_kwargs(num_threads=2))
    load = other_cpu_load()
    settings = [("greedy", 0.0, sampler.sample_one)] + [
        (name, 1.0, fn) for name, fn in SAMPLERS.items()]
    times: dict[tuple[str, int], list[float]] = {(s[0], b): [] for s in settings for b in BATCHES}
    step_times(engine, 1, 1.0, 2)  # warm-up
    for r in range(args.rounds):
        for name, temperature, fn in settings if r % 2 == 0 else reversed(settings):
            with using(fn):
                for b in BATCHES:
                    times[(name, b)] += step_times(engine, b, temperature, steps)
        print(f"round {r}: " + ", ".join(f"{k[0]} b{k[1]} {1e3 * median(v):.1f} ms"
                                         for k, v in times.items()), flush=True)
    ms = {k: 1e3 * median(v) for k, v in times.items()}
    rows = []
    for b in BATCHES:
        greedy, now, before = (ms[(s[0], b)] for s in settings)
        rows.append([b, f"{greedy:.1f}", f"{before:.1f} ({before - greedy:+.1f})",
                     f"{now:.1f} ({now - greedy:+.1f})", f"{now / before:.2f}x",
                     f"{(now - greedy) / b:+.2f} vs {(before - greedy) / b:+.2f}"])
    header = ["batch", "greedy step ms", "sampled, exponential race (before) ms",
              "sampled, inverse CDF (now) ms", "now / before",
              "sampling ms per row (now vs before)"]
    body = "\n".join([
        f"Decode steps of the default model (bf16, {torch.get_num_threads()} threads, "
        f"vocabulary {engine.spec.vocab_size}), temperature 1 against greedy on one engine; "
        f"median over {args.rounds} interleaved rounds of {steps} steps. Other CPU load at "
        f"start: {load:.2f} cores.", "", markdown_table(header, rows)])
    print(body)
    if not args.quick:
        write_section(args.output, "Engine: sampled decode", body, machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
