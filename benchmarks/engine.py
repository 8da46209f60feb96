"""Engine throughput on CPU: prefill, batch-1 decode, batch-32 decode, against HF
transformers and against the machine's own limits, all measured in one run.

    python benchmarks/engine.py                # ~5-8 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/engine.py --quick        # smoke run: 1 repetition, short decodes
    python benchmarks/engine.py --no-hf        # skip the HF transformers reference
    python benchmarks/engine.py --profile      # top torch.profiler/cProfile entries, no doc
    python benchmarks/engine.py --output PATH  # where the `## Engine` section goes

What is measured (default model SmolLM2-135M-Instruct, engine dtype bf16, 2 threads):
- prefill: a 512-token prompt, max_tokens=1, time from add_request to the first token
  (one engine step: max_num_batched_tokens >= 512, prefix caching off, a fresh random
  prompt every repetition);
- decode, batch 1: 128-token prompt, 128 new tokens (greedy, ignore_eos); only the steps
  after the prefill step are timed: 127 tokens / their time;
- decode, batch 32: 32 random prompts of 128 tokens prefilled in one step, then 127 steps
  of 32 decodes each; only those steps are timed;
- HF transformers (dense fp32 model with the GGUF's dequantized weights, and the same
  weights cast to bf16): prefill = one forward of 512 tokens (cache on, logits for the
  last position, as `generate` does); decode = a greedy loop with past_key_values;
- the machine's ceilings: bf16 GEMM 2048^3 FLOP/s and DRAM read bandwidth (1 GiB filled
  buffer), and the roofline bound of each engine figure from them; beside them, torch's own
  linear (oneDNN) over the model's projections at the prefill's 512 rows, the rate the
  field's library reaches at these shapes, and the prefill's share of a bound built on it.
Figures are medians over the repetitions (after a warm-up); min-max in brackets.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
try:
    from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes, command_line,
                                   machine_description, measure_dram_read_bandwidth,
                                   measure_gemm_flops, measure_linear_flops, now_utc,
                                   other_cpu_load, write_section)
except ImportError:  # run as a plain script from benchmarks/
    from common import (DEFAULT_OUTPUT, CpuMonitor, busy_processes,  # type: ignore[no-redef]
                        command_line, machine_description, measure_dram_read_bandwidth,
                        measure_gemm_flops, measure_linear_flops, now_utc, other_cpu_load,
                        write_section)

from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.model import kernels

if _HERE not in sys.path:  # the sibling modules below
    sys.path.insert(0, _HERE)
from engine_measure import (BATCH, DECODE_PROMPT_LEN, PREFILL_LEN, Figure,  # noqa: E402
                            bounds, engine_decode, engine_prefill, hf_decode, hf_prefill,
                            load_hf_reference, model_shapes, random_prompts)
from engine_profile import profile  # noqa: E402
from engine_report import (BUSY_CORES, TARGETS, dtype_name, fmt_flops,  # noqa: E402
                           kernels_label, report)



# -- the run --------------------------------------------------------------------------------
@dataclass
class Settings:
    reps: int
    new_tokens: int  # batch 1 and batch 32
    warmup_new_tokens: int


def ceiling_dtype(engine: LLMEngine) -> torch.dtype:
    """The GEMM whose FLOP/s is the engine's compute ceiling: bf16, except where the exact
    kernels run their AVX2 path, which multiplies widened bf16 with fp32 FMAs (no bf16 dot
    product on the CPU; torch's bf16 GEMM there is emulated, minutes for one 2048^3)."""
    if engine.batch_invariant and kernels.isa_name() == "avx2":
        return torch.float32
    return torch.bfloat16


def dtype_label(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def make_engine(args: argparse.Namespace, quantization: str | None = None,
                batch_invariant: bool | None = None) -> LLMEngine:
    # The CPU engine, also on a machine with a GPU: the bounds are this CPU's GEMM and DRAM.
    return LLMEngine(EngineConfig.from_kwargs(
        args.model, dtype=args.dtype, device="cpu", num_threads=args.threads,
        enable_prefix_caching=False,
        quantization=quantization, batch_invariant=batch_invariant,
        max_num_batched_tokens=max(PREFILL_LEN, BATCH * DECODE_PROMPT_LEN),
        max_num_seqs=max(64, BATCH)))


class Guard:
    """Runs a measurement and redoes it when other processes used the CPU meanwhile (at most
    `retries` redos in the whole run), so a short burst of someone else's work does not end
    up in a median."""

    def __init__(self, log, retries: int) -> None:
        self.log, self.retries_left = log, retries
        self.discarded = 0
        self.worst_kept = 0.0  # most cores other processes used during a kept measurement

    def __call__(self, label: str, fn):
        while True:
            mon = CpuMonitor().start()
            result = fn()
            load = mon.stop()
            if load < BUSY_CORES or self.retries_left <= 0:
                self.worst_kept = max(self.worst_kept, load)
                return result
            self.retries_left -= 1
            self.discarded += 1
            self.log(f"  {label}: other processes used {load:.2f} cores meanwhile; redoing it")


def dram_now() -> float:
    """DRAM read bytes/s at this moment (best of 3 sums over 256 MiB, ~0.2 s)."""
    return measure_dram_read_bandwidth(1 << 28, reps=3).best


def run_engines(engines: dict[str, LLMEngine], st: Settings, guard: Guard, log
                ) -> tuple[dict[str, dict[str, Figure]], dict[str, list[float]]]:
    """Every engine's figures, and per batch-1 repetition the DRAM read bandwidth around
    it (the mean of one measured right before and one right after: this VM's bandwidth
    moves with its neighbours by 2x within minutes, so a share of the bound is fairest
    against the bandwidth of the same moments). Repetitions interleave the engines, so a
    slow spell of the machine falls on all of them and their ratios stay fair."""
    figs = {label: {k: Figure() for k in TARGETS} for label in engines}
    around: dict[str, list[float]] = {label: [] for label in engines}
    for engine in engines.values():  # warm-up: the same shapes, shorter decodes
        vocab = engine.spec.vocab_size
        engine_prefill(engine, random_prompts(1, PREFILL_LEN, vocab)[0])
        engine_decode(engine, random_prompts(1, DECODE_PROMPT_LEN, vocab), st.warmup_new_tokens)
        engine_decode(engine, random_prompts(BATCH, DECODE_PROMPT_LEN, vocab),
                      st.warmup_new_tokens)
    for rep in range(st.reps):
        for label, engine in engines.items():
            vocab, f = engine.spec.vocab_size, figs[label]
            t = guard("engine prefill", lambda: engine_prefill(
                engine, random_prompts(1, PREFILL_LEN, vocab)[0]))
            f["prefill"].samples.append(PREFILL_LEN / t)
            before = dram_now()
            t, n = guard("engine decode b1", lambda: engine_decode(
                engine, random_prompts(1, DECODE_PROMPT_LEN, vocab), st.new_tokens))
            around[label].append((before + dram_now()) / 2)
            f["decode_b1"].samples.append(n / t)
            t, n = guard("engine decode b32", lambda: engine_decode(
                engine, random_prompts(BATCH, DECODE_PROMPT_LEN, vocab), st.new_tokens))
            f["decode_b32"].samples.append(n / t)
            log(f"  {label[:40]} rep {rep + 1}: prefill {f['prefill'].samples[-1]:.0f} tok/s, "
                f"decode b1 {f['decode_b1'].samples[-1]:.1f}, "
                f"b32 {f['decode_b32'].samples[-1]:.0f} (DRAM around b1: "
                f"{around[label][-1] / 1e9:.1f} GB/s)")
    return figs, around


def run_hf(model: nn.Module, vocab: int, st: Settings, b32: bool, guard: Guard, log,
           label: str) -> dict[str, Figure]:
    figs = {k: Figure() for k in TARGETS}
    hf_prefill(model, random_prompts(1, PREFILL_LEN, vocab)[0])
    hf_decode(model, random_prompts(1, DECODE_PROMPT_LEN, vocab), st.warmup_new_tokens)
    if b32:
        hf_decode(model, random_prompts(BATCH, DECODE_PROMPT_LEN, vocab), st.warmup_new_tokens)
    for rep in range(st.reps):
        t = guard(f"{label} prefill", lambda: hf_prefill(
            model, random_prompts(1, PREFILL_LEN, vocab)[0]))
        figs["prefill"].samples.append(PREFILL_LEN / t)
        t, n = guard(f"{label} decode b1", lambda: hf_decode(
            model, random_prompts(1, DECODE_PROMPT_LEN, vocab), st.new_tokens))
        figs["decode_b1"].samples.append(n / t)
        if b32:
            t, n = guard(f"{label} decode b32", lambda: hf_decode(
                model, random_prompts(BATCH, DECODE_PROMPT_LEN, vocab), st.new_tokens))
            figs["decode_b32"].samples.append(n / t)
        log(f"  {label} rep {rep + 1}: prefill {figs['prefill'].samples[-1]:.0f} tok/s, "
            f"decode b1 {figs['decode_b1'].samples[-1]:.1f}"
            + (f", b32 {figs['decode_b32'].samples[-1]:.0f}" if b32 else ""))
    return figs


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, short decodes")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers reference")
    ap.add_argument("--hf-b32", choices=["on", "off"], default="on",
                    help="HF batch-32 decode (slow in fp32)")
    ap.add_argument("--profile", action="store_true",
                    help="print profiles of one 512-token prefill and decode steps; no benchmark")
    ap.add_argument("--output", default=DEFAULT_OUTPUT,
                    help="markdown file whose `## Engine` section is (re)written; '-' for none")
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto = bfloat16)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; quick 1)")
    ap.add_argument("--fast", choices=["on", "off"], default="on",
                    help="also measure the fast path (--no-batch-invariant: oneDNN + SDPA)")
    ap.add_argument("--int8", choices=["on", "off"], default="on",
                    help="also measure the engine with int8 weight-only quantization")
    ap.add_argument("--max-redos", type=int, default=6,
                    help="measurements disturbed by other processes are redone, at most this "
                         "many times in the run")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    log = functools.partial(print, flush=True)

    load_before = other_cpu_load(2.0)
    busy = busy_processes() if load_before >= BUSY_CORES else []
    if load_before >= BUSY_CORES:
        log(f"WARNING: other processes use {load_before:.2f} cores of {os.cpu_count()}; "
            "figures will be distorted (OpenMP threads get descheduled). Run on a quiet machine.")
        for b in busy[:5]:
            log(f"  {b}")

    t_load = time.perf_counter()
    engine = make_engine(args)
    log(f"engine loaded in {time.perf_counter() - t_load:.1f} s ({engine.dtype}, "
        f"{torch.get_num_threads()} threads)")
    if args.profile:
        profile(engine, log)
        return 0

    st = Settings(reps=args.reps or (1 if args.quick else 3),
                  new_tokens=32 if args.quick else 128, warmup_new_tokens=4 if args.quick else 8)
    guard = Guard(log, args.max_redos)
    monitor = CpuMonitor().start()
    t_start = time.perf_counter()
    log("machine limits ...")
    dtype = ceiling_dtype(engine)
    gemm = guard(f"{dtype_label(dtype)} GEMM", lambda: measure_gemm_flops(dtype, 2048))
    dram = guard("DRAM read", lambda: measure_dram_read_bandwidth(1 << 30))
    linears = guard("linears at the model's shapes", lambda: measure_linear_flops(
        model_shapes(engine), PREFILL_LEN, engine.spec.num_layers, dtype))
    log(f"  {dtype_label(dtype)} GEMM 2048^3: {fmt_flops(gemm.best)} "
        f"(median {fmt_flops(gemm.median)}); "
        f"DRAM read: {dram.best / 1e9:.1f} GB/s (median {dram.median / 1e9:.1f}); "
        f"linears at the model's shapes: {fmt_flops(linears.best)}")

    engines = {f"**splitserve** ({dtype_name(engine)}, {kernels_label(engine)}, this run)": engine}
    if args.fast == "on" and engine.batch_invariant:
        fast = make_engine(args, batch_invariant=False)
        engines[f"splitserve `--no-batch-invariant` ({kernels_label(fast)}, this run)"] = fast
    int8 = None
    if args.int8 == "on":
        int8 = make_engine(args, quantization="int8")
        engines[f"splitserve int8 weight-only (opt-in `quantization=\"int8\"`, "
                f"{kernels_label(int8)}, this run)"] = int8
    log(f"splitserve engines: {', '.join(engines)} ...")
    results, around = run_engines(engines, st, guard, log)
    # the bounds of each exact-kernel row (the fast path's are the first row's)
    bnds = {label: bounds(e, gemm.best, dram.best, st.new_tokens)
            for label, e in engines.items() if e is engine or e is int8}
    del engines, int8
    if not args.no_hf:
        from splitserve.model.default import default_model_path
        path = args.model or default_model_path()
        if not path.endswith(".gguf"):
            raise SystemExit("the HF reference is built from a .gguf file; use --no-hf")
        vocab = engine.spec.vocab_size
        log("HF transformers fp32 ...")
        hf32 = load_hf_reference(path)
        b32 = args.hf_b32 == "on"
        results["HF transformers fp32 (dense GGUF weights, this run)"] = run_hf(
            hf32, vocab, st, b32, guard, log, "HF fp32")
        log("HF transformers bf16 ...")
        hf16 = hf32.to(torch.bfloat16)
        del hf32
        results["HF transformers bf16 (same weights cast, this run)"] = run_hf(
            hf16, vocab, st, b32, guard, log, "HF bf16")
        del hf16
    load_during = monitor.stop()
    log(f"measured in {time.perf_counter() - t_start:.0f} s; other processes used "
        f"{load_during:.2f} cores on average meanwhile, {guard.discarded} measurement(s) redone")

    at_shapes = bounds(engine, linears.best, dram.best, st.new_tokens)["prefill"]
    body = report(args, st, engine, results, (dtype_label(dtype), gemm), dram, bnds, around,
                  load_before, guard, busy, (linears, at_shapes))
    print("\n" + body + "\n")
    if args.output != "-":
        write_section(args.output, "Engine", body, machine=machine_description(),
                      command=command_line(), date=now_utc())
        log(f"wrote the `## Engine` section of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
