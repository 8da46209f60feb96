"""The profiling child of profile.py: `python -m splitserve.cluster.planner.profile_run`
with a JSON request on stdin ({"engine_args", "threads", "cores", "plan"}). Loads one
engine, then at each thread count, ascending, pins itself to the first that many cores
and times what a worker's steps would take: whole prompts (max_tokens=1, every chunk's
step) and pure decode steps at each batch size. One JSON line per thread count on
stdout: {"threads", "prefill": [[tokens, s], ...], "decode": [[seqs, s], ...],
"fingerprint", "batch_invariant"}. Logs go to stderr.

Seconds are the engine's own step times (LLMEngine.last_step), the samples a worker
reports to the router. Prompts are random token ids, so no prefix is ever a cache hit.
"""
from __future__ import annotations

import json
import logging
import os
import random
import sys
from dataclasses import replace
from typing import Any

import torch

from splitserve.cluster.planner.profile import ProfilePlan
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams

_MAX_KV_BLOCKS = 1024  # the prompts and batches measured need far fewer than a server's


def _prompt(rng: random.Random, vocab_size: int, num_tokens: int) -> list[int]:
    # Clear of the low ids, where tokenizers keep their special tokens.
    return [rng.randrange(256, vocab_size) for _ in range(num_tokens)]


def _run(engine: LLMEngine, max_steps: int) -> list[tuple[int, int, float]]:
    """Steps until nothing is left; (prefill tokens, decode seqs, seconds) per step."""
    steps: list[tuple[int, int, float]] = []
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return steps
        engine.step()
        assert engine.last_step is not None
        stats = engine.last_step
        steps.append((stats.num_prefill_tokens, stats.num_decode_seqs, stats.seconds))
    raise RuntimeError(f"the engine had work left after {max_steps} steps")


def measure_prefill(engine: LLMEngine, rng: random.Random, sizes: list[int],
                    repeats: int) -> list[tuple[int, float]]:
    """(prompt tokens, seconds to prefill it whole and sample its first token)."""
    samples: list[tuple[int, float]] = []
    for _ in range(repeats):
        for size in sizes:
            engine.add_request(f"prefill-{len(samples)}", _prompt(rng, engine.spec.vocab_size,
                                                                  size),
                               SamplingParams(max_tokens=1))
            steps = _run(engine, max_steps=size + 4)  # a time budget may cut small chunks
            samples.append((size, sum(seconds for *_, seconds in steps)))
    return samples


def measure_decode(engine: LLMEngine, rng: random.Random, batches: list[int],
                   plan: ProfilePlan) -> list[tuple[int, float]]:
    """(running sequences, seconds of one step that only decodes them), over
    `plan.decode_repeats` passes, the odd ones in descending order."""
    samples: list[tuple[int, float]] = []
    for repeat in range(plan.decode_repeats):
        for batch in batches[::-1] if repeat % 2 else batches:
            samples += [(batch, seconds)
                        for seconds in _decode_batch(engine, rng, batch, plan, repeat)]
    return samples


def measure_context(engine: LLMEngine, rng: random.Random, plan: ProfilePlan, limit: int,
                    batch: int) -> list[tuple[int, float]]:
    """(context tokens, seconds) of decode steps over `batch` sequences after a long
    prompt each (the context each step reads, at its middle), between two passes of the
    same batch after short prompts: the difference is measured back to back, where one
    against the fitted curve drowned 4 x 240 tokens (~1 ms) in a noisy batch's fit. At
    most half the context limit: the first sequences decode while the others prefill (in
    16-token chunks under a 1 ms step budget) and must not reach the limit before."""
    prompt = max(plan.decode_prompt_tokens, min(plan.decode_context_tokens,
                                                (limit - plan.decode_steps - 1) // 2))
    samples: list[tuple[int, float]] = []
    for repeat, tokens in enumerate((plan.decode_prompt_tokens, prompt,
                                     plan.decode_prompt_tokens)):
        context = tokens + plan.decode_steps // 2
        samples += [(context, seconds) for seconds
                    in _decode_batch(engine, rng, batch, plan, 100 + repeat, tokens)]
    return samples


def _decode_batch(engine: LLMEngine, rng: random.Random, batch: int, plan: ProfilePlan,
                  repeat: int, prompt_tokens: int | None = None) -> list[float]:
    prompt_tokens = prompt_tokens or plan.decode_prompt_tokens
    ids = [f"decode-{repeat}-{batch}-{prompt_tokens}-{i}" for i in range(batch)]
    # They decode until aborted below: however small the step budget's chunks, the
    # first admitted are still decoding when the last one joins them.
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, _prompt(rng, engine.spec.vocab_size, prompt_tokens), params)
    timed = []
    for _ in range(plan.decode_steps + batch * prompt_tokens + 4):
        engine.step()
        stats = engine.last_step
        assert stats is not None
        if stats.num_prefill_tokens == 0 and stats.num_decode_seqs == batch:
            timed.append(stats.seconds)
            if len(timed) == plan.decode_steps:
                break
    else:
        raise RuntimeError(f"no {plan.decode_steps} pure decode steps at batch {batch}")
    for rid in ids:
        engine.abort(rid)
    return timed


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s profile %(levelname)s %(name)s: %(message)s")
    request: dict[str, Any] = json.loads(sys.stdin.read())
    counts, cores = list(request["threads"]), list(request["cores"])
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v
                              for k, v in request["plan"].items()}
    plan = ProfilePlan(**fields)
    args = {k: v for k, v in request["engine_args"].items() if k != "num_threads"}
    os.sched_setaffinity(0, cores[:counts[0]])
    config = EngineConfig.from_kwargs(args.pop("model", None), **args,
                                      num_threads=counts[0])
    config = replace(config, cache=replace(config.cache, num_blocks=_MAX_KV_BLOCKS))
    engine = LLMEngine(config)
    limit = engine.max_model_len - 1
    sizes = sorted({min(t, limit) for t in plan.prefill_tokens})
    batches = sorted({min(n, config.scheduler.max_num_seqs) for n in plan.decode_batches})
    rng = random.Random(0)
    for count in counts:
        # NOTE: ascending counts widen the mask: OpenMP threads started now inherit the
        # main thread's, those of a smaller count keep a subset of it.
        os.sched_setaffinity(0, cores[:count])
        torch.set_num_threads(count)
        measure_prefill(engine, rng, sizes[:1], 1)  # warm-up: first-call costs
        prefill = measure_prefill(engine, rng, sizes, plan.prefill_repeats)
        decode = measure_decode(engine, rng, batches, plan)
        context_batch = min(plan.decode_context_batch, config.scheduler.max_num_seqs)
        context = measure_context(engine, rng, plan, limit, context_batch)
        print(json.dumps({"threads": count, "prefill": prefill, "decode": decode,
                          "decode_context": context, "context_batch": context_batch,
                          "short_context": plan.decode_prompt_tokens + plan.decode_steps // 2,
                          "fingerprint": engine.fingerprint,
                          "batch_invariant": engine.batch_invariant}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
