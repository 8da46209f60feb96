"""Workloads: the list of requests a run sends (prompt token ids, output length, session
order), built from synthetic length distributions, sessions or a trace, then length-scaled
and fitted to the server's context."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.bench.config import BenchConfig, LengthDist
from splitserve.bench.lengths import fit_lengths, sample_lengths, scale_length
from splitserve.bench.request import BenchRequest
from splitserve.bench.sessions import build_sessions
from splitserve.bench.tokens import TokenSynth
from splitserve.bench.traces import (DEFAULT_JITTER_S, default_trace_path,
                                     prompt_from_hash_ids, read_trace, scaled_block_size)


@dataclass(frozen=True)
class WorkloadInfo:
    """What was built, with every scaling applied (printed in the report)."""
    kind: str
    description: str
    num_requests: int
    length_scale: float
    max_model_len: int | None
    num_clamped: int  # requests whose lengths were cut to fit max_model_len
    mean_input_len: float
    max_input_len: int
    mean_output_len: float
    max_output_len: int
    prefix_reuse_ratio: float  # prompt tokens an infinite 16-token-block prefix cache would hit
    trace_path: str | None = None
    block_size: int | None = None  # Mooncake: tokens per hash id after scaling
    num_sessions: int | None = None
    num_dropped: int = 0  # session turns dropped because the history outgrew the context


@dataclass
class Workload:
    requests: list[BenchRequest]
    info: WorkloadInfo
    jitter_s: float = 0.0  # trace arrivals: uniform jitter added to each timestamp


def prefix_reuse_ratio(prompts: Sequence[Sequence[int]], block_size: int = 16) -> float:
    """Fraction of all prompt tokens that lie in a full block whose whole prefix (chained
    like the server's block hashes) appeared in an earlier prompt or earlier in this one."""
    seen: set[int] = set()
    reused = total = 0
    for prompt in prompts:
        total += len(prompt)
        parent, is_hit = 0, True
        for start in range(0, len(prompt) - block_size + 1, block_size):
            parent = hash((parent, tuple(prompt[start:start + block_size])))
            is_hit = is_hit and parent in seen
            reused += block_size if is_hit else 0
            seen.add(parent)
    return reused / total if total else 0.0


def build_workload(config: BenchConfig, max_model_len: int | None) -> Workload:
    """The requests of `config`'s workload, lengths scaled by `config.length_scale` and
    fitted to `max_model_len` (None: no limit). Deterministic in (seed, run_index)."""
    rng = np.random.default_rng([config.seed, 0])  # lengths: the same for every run_index
    synth = TokenSynth(config.seed, config.run_index, config.token_low, config.token_high)
    scale, n = config.length_scale, config.num_requests
    if config.workload == "sessions":
        requests, num_sessions, num_dropped, num_clamped = build_sessions(
            config, synth, rng, max_model_len)
        desc = (f"sessions: {num_sessions} sessions of up to {config.turns} turns, shared "
                f"system prompt {scale_length(config.system_len, scale)} tokens, "
                f"{_dist_text(config.input_len)} user tokens and {_dist_text(config.output_len)} "
                "reply tokens per turn (scaled)")
        return _workload(config, requests, desc, max_model_len, num_clamped,
                         num_sessions=num_sessions, num_dropped=num_dropped)
    if config.workload == "synthetic":
        inputs = sample_lengths(config.input_len, n, rng)
        outputs = sample_lengths(config.output_len, n, rng)
        rows: list[tuple[float | None, int, int, tuple[int, ...]]] = [
            (None, i, o, ()) for i, o in zip(inputs, outputs)]
        desc = (f"synthetic: input {_dist_text(config.input_len)}, output "
                f"{_dist_text(config.output_len)}")
        trace_path = None
    else:
        records = read_trace(config.workload, config.trace, n)
        rows = [(r.timestamp_s, r.input_len, r.output_len, r.hash_ids) for r in records]
        trace_path = str(config.trace or default_trace_path(config.workload))
        desc = f"{config.workload} trace replay: first {len(rows)} requests of {trace_path}"
    block_size = scaled_block_size(scale) if config.workload == "mooncake" else None
    requests, num_clamped = [], 0
    for index, (timestamp, inp, out, hash_ids) in enumerate(rows):
        inp, out = scale_length(inp, scale), scale_length(out, scale)
        fitted = fit_lengths(inp, out, max_model_len)
        num_clamped += fitted != (inp, out)
        if block_size is not None:
            prompt = prompt_from_hash_ids(hash_ids, inp, block_size, synth, index)[:fitted[0]]
        else:
            prompt = synth.request(index, fitted[0])
        requests.append(BenchRequest(prompt, fitted[1], timestamp_s=timestamp))
    jitter = 0.0
    if config.is_trace:
        jitter = (config.trace_jitter_s if config.trace_jitter_s is not None
                  else DEFAULT_JITTER_S[config.workload])
    workload = _workload(config, requests, desc, max_model_len, num_clamped,
                         trace_path=trace_path, block_size=block_size)
    workload.jitter_s = jitter
    return workload


def _dist_text(dist: LengthDist) -> str:
    if dist.kind == "fixed":
        return f"fixed {dist.mean}"
    return f"{dist.kind} mean {dist.mean} spread {dist.spread:g}"


def _workload(config: BenchConfig, requests: list[BenchRequest], description: str,
              max_model_len: int | None, num_clamped: int, **extra: object) -> Workload:
    inputs = [len(r.prompt_token_ids) for r in requests]
    outputs = [r.output_len for r in requests]
    if config.length_scale != 1.0:
        description += f"; lengths scaled x{config.length_scale:g}"
    info = WorkloadInfo(
        kind=config.workload, description=description, num_requests=len(requests),
        length_scale=config.length_scale, max_model_len=max_model_len, num_clamped=num_clamped,
        mean_input_len=float(np.mean(inputs)), max_input_len=max(inputs),
        mean_output_len=float(np.mean(outputs)), max_output_len=max(outputs),
        prefix_reuse_ratio=prefix_reuse_ratio([r.prompt_token_ids for r in requests]),
        **extra)  # type: ignore[arg-type]
    return Workload(requests, info)
