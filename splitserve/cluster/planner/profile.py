"""Measured cost curves for `--mode auto` (layout.py): one worker's prefill time of a
whole prompt of t tokens and decode step time at n sequences, at each thread count,
measured on a real engine in a child process pinned like a worker (profile_run.py) and
fitted by the router's own cost models (router/cost_model.py), then cached in a JSON
file so that later starts on the same machine, model and settings measure nothing.

A cache entry is keyed by what decides the timings, read without loading torch (the
frontend, which looks the curves up, runs no model: torch would be ~1.2 s of every start
and ~200 MB of its memory): the model's weights, the engine settings (device, dtype,
quantization, batch invariance, block size, the prefill chunk), the threads, the CPU
(model and the ISA it exposes), what else picks the kernels' ISA or a GPU (the ISA caps in
the environment, torch's build, a GPU driver) and the engine's code. The entry keeps the
model fingerprint of the engine measured (kernels included, as the engine resolves them);
once the workers register, the launcher compares theirs and drops the entries of a key
whose engine is not the one serving (auto_layout.check_measured_engine), so the next start
measures again.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from splitserve.cluster.router.cost_model import (CostModelConfig, DecodeStepModel,
                                                  PrefillCostModel, Quadratic)
from splitserve.config import EngineConfig
from splitserve.errors import LayoutProfileError

logger = logging.getLogger(__name__)

CACHE_ENV = "SPLITSERVE_PROFILE_CACHE"
CACHE_VERSION = 5  # 2: the decode step's cost per token of context; 3: out of cache;
# 4: that cost against short steps of the same batch measured beside it (a noisy fit gave 0);
# 5: keys read without torch, the engine's fingerprint in the entry
# The child loads the model (~10 s on 2 cores, more the first time the exact kernels
# are built) and measures for ~5 s per thread count on an idle machine: far inside this.
PROFILE_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class ProfilePlan:
    """What the child measures at each thread count."""

    # Capped below max_model_len; each size's fastest run counts (fit_curves). ~5 s on
    # one core, where a 1024-token prompt alone takes 2 s.
    prefill_tokens: tuple[int, ...] = (64, 256, 1024)
    prefill_repeats: int = 2
    decode_batches: tuple[int, ...] = (1, 8, 32)  # capped at max_num_seqs
    decode_steps: int = 4  # pure decode steps timed per batch size and pass
    decode_prompt_tokens: int = 16
    # Passes over the batches, ascending then descending: a slow phase of the machine
    # (a neighbour's burst) lands on different sizes in each, and each size's fastest
    # step counts, where one ascending pass let it slow only the smallest batches.
    decode_repeats: int = 2
    # Decode steps with this much context as well (capped below max_model_len): a step's
    # attention reads every token of each sequence's context, which at 2K tokens doubled a
    # one-core step of the default model (7 -> 14 ms, goodput table (a)).
    decode_context_tokens: int = 1024
    # ... over this many sequences (capped at max_num_seqs), one pass: their KV (4 x 1,024
    # tokens x 23 KB for the default model, 94 MB) outgrows a last-level cache as a served
    # batch of long contexts does. One sequence's (24 MB) stayed in a Zen 3's 32 MB L3 and
    # cost a fifth of what a served step paid per token (0.56 against ~3 us at 2 threads).
    decode_context_batch: int = 4

    def __post_init__(self) -> None:
        if min(self.prefill_tokens, default=0) < 1 or min(self.decode_batches, default=0) < 1:
            raise ValueError("a profile plan needs positive prefill sizes and decode batches")
        if len(set(self.prefill_tokens)) < 3 or len(set(self.decode_batches)) < 3 or min(
                self.prefill_repeats, self.decode_steps, self.decode_repeats,
                self.decode_context_batch) < 1:
            raise ValueError("a profile plan needs 3 sizes per curve to fit one, each run "
                             "at least once")


@dataclass(frozen=True)
class ProfileKey:
    weights: str  # the checkpoint's weights digest
    settings: str  # the engine settings that decide a step's time, as JSON
    threads: int
    cpu_model: str
    platform: str  # what else picks the kernels' ISA or a GPU (platform_marks)
    # Digest of the engine's and the model's code (engine_code_digest): a faster kernel
    # or runner measures again instead of reusing the old code's curves.
    code: str = ""

    @property
    def cache_id(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))


class CostCurves(NamedTuple):
    """One worker's curves at one thread count, in seconds."""

    prefill: Quadratic  # a whole prompt of t uncached tokens (every chunk's step)
    decode: Quadratic  # one decode step over n running sequences of (almost) no context
    decode_per_context_s: float = 0.0  # what a step adds per sequence per context token
    fingerprint: str = ""  # the model fingerprint of the engine measured ("": not known)


# Flags that pick the kernels' code path (exact kernels: avx2 or avx512_bf16; oneDNN: AMX).
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, family/model and kernel-relevant ISA flags (/proc/cpuinfo),
    else what the platform says. Two VMs of one name may expose different ISAs (a Zen 4
    with its AVX-512 hidden runs the exact kernels' AVX2 path, 2-4x slower): their curves
    must not be shared."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                    fields[key] = value.strip()
                if key == "" and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine() or "unknown"
    flags = set(fields.get("flags", "").split())
    isa = " ".join(flag for flag in _ISA_FLAGS if flag in flags) or "no avx2"
    return (f"{fields['model name']} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {isa})")


def engine_code_digest() -> str:
    """blake2b over the sources that decide a step's time: splitserve/engine and
    splitserve/model (the exact kernels' C++ included)."""
    root = Path(__file__).resolve().parents[2]
    files = sorted(p for d in ("engine", "model") for p in (root / d).rglob("*")
                   if p.suffix in (".py", ".cpp", ".h"))
    h = hashlib.blake2b(digest_size=8)
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def default_cache_path() -> Path:
    """$SPLITSERVE_PROFILE_CACHE, else ~/.cache/splitserve/layout_profiles.json (or under
    $XDG_CACHE_HOME)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "splitserve" / "layout_profiles.json"


# The environment that caps or picks the kernels' ISA (the exact kernels', ATen's,
# oneDNN's) or hides GPUs.
_PLATFORM_ENV = ("SPLITSERVE_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                 "CUDA_VISIBLE_DEVICES")


def platform_marks() -> str:
    """What picks the engine's code path besides the CPU and the settings, read without
    loading torch: _PLATFORM_ENV, torch's build (a CUDA build or another version) and
    whether an NVIDIA driver is loaded."""
    try:
        torch_build = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_build = "none"
    env = {name: os.environ[name] for name in _PLATFORM_ENV if name in os.environ}
    return json.dumps({"torch": torch_build, "nvidia": os.path.exists("/proc/driver/nvidia"),
                       "env": env}, sort_keys=True, separators=(",", ":"))


def profile_key(engine_args: Mapping[str, Any], threads: int) -> ProfileKey:
    """The cache key of a worker with `engine_args` (WorkerSpec.engine_args) at `threads`;
    loads no torch (the module docstring says what it holds)."""
    from splitserve.model.loader import open_checkpoint

    args = dict(engine_args)
    config = EngineConfig.from_kwargs(args.pop("model", None), **args)
    settings = {"device": config.device, "dtype": config.dtype,
                "quantization": config.quantization,
                "batch_invariant": config.batch_invariant,
                "block_size": config.cache.block_size,
                "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
                "max_step_ms": config.scheduler.max_step_ms}
    return ProfileKey(open_checkpoint(config.model).weights_digest,
                      json.dumps(settings, sort_keys=True, separators=(",", ":")), threads,
                      cpu_model(), platform_marks(), engine_code_digest())


def fit_curves(prefill: Sequence[tuple[int, float]], decode: Sequence[tuple[int, float]],
               context: Sequence[tuple[int, float]] = (), short_context: int = 0,
               context_batch: int = 1) -> CostCurves:
    """The router's fits over the samples, (tokens, seconds) and (sequences, seconds),
    through each curve's envelope (`_envelope`): the curves are meant to be the cost on
    cores of their own. Needs 3 sizes of each. `context`: (context tokens, seconds) of
    steps over `context_batch` sequences at a long context and, measured beside them, at
    `short_context`: their fastest over the fastest short ones (over the fitted step at
    that batch when none is short), per sequence per token more (never negative)."""
    prefill_model = PrefillCostModel(_fit_config(prefill))
    decode_model = DecodeStepModel(_fit_config(decode))
    for model, samples in ((prefill_model, prefill), (decode_model, decode)):
        for size, seconds in _envelope(samples) or []:
            model.observe(size, seconds)
    if not (prefill_model.is_fitted and decode_model.is_fitted):
        raise LayoutProfileError(f"the measured timings fit no non-decreasing curve over 3 "
                                 f"sizes or more (prefill {_fastest(prefill)}, decode "
                                 f"{_fastest(decode)}): the machine was too busy to measure, "
                                 f"or max_model_len / max_num_seqs leave too few sizes; "
                                 f"choose --mode agg|disagg")
    decode_curve = Quadratic(*decode_model.coefficients)
    fastest = dict(_fastest(context))
    short = fastest.pop(short_context, decode_curve(context_batch))
    per_context = 0.0
    for tokens, seconds in sorted(fastest.items())[-1:]:
        if tokens > short_context:
            per_context = max(0.0, (seconds - short)
                              / (context_batch * (tokens - short_context)))
    return CostCurves(Quadratic(*prefill_model.coefficients), decode_curve, per_context)


# How far under a smaller size's time a larger size's may fall and still be noise.
_NOISE = 0.25


def _fastest(samples: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    best: dict[int, float] = {}
    for size, seconds in samples:
        best[size] = min(seconds, best.get(size, seconds))
    return sorted(best.items())


def _envelope(samples: Sequence[tuple[int, float]]) -> list[tuple[int, float]] | None:
    """Each size's fastest sample (other processes only ever add time: a step descheduled
    for 0.5 s among 15 ms ones), raised to the largest of the smaller sizes': more tokens
    or sequences never cost less, and where the step is flat (decode batches 1-4 on AMX
    tiles, all bound by reading the weights) the sizes differ by noise alone. None when a
    size falls more than _NOISE under a smaller one: that is not noise."""
    envelope: list[tuple[int, float]] = []
    for size, seconds in _fastest(samples):
        top = envelope[-1][1] if envelope else 0.0
        if seconds < (1 - _NOISE) * top:
            return None
        envelope.append((size, max(seconds, top)))
    return envelope


def _fit_config(samples: Sequence[tuple[int, float]]) -> CostModelConfig:
    # Every size in one window, fitted once all are in (not before: min_samples).
    num_sizes = max(3, len({size for size, _ in samples}))
    return CostModelConfig(window=num_sizes, min_samples=num_sizes)


def measure_curves(engine_args: Mapping[str, Any], threads: Sequence[int], *,
                   plan: ProfilePlan = ProfilePlan(),
                   timeout_s: float = PROFILE_TIMEOUT_S) -> dict[int, CostCurves]:
    """Runs one child process (the model loaded once) that measures at each thread count,
    ascending, pinned to the first that many of this process's cores, as worker 0 of a
    layout with that many threads per worker would be; each count's curves carry the
    child's model fingerprint. LayoutProfileError when it fails or passes `timeout_s`."""
    cores = sorted(os.sched_getaffinity(0))
    counts = sorted(set(threads))
    if not counts or counts[0] < 1 or counts[-1] > len(cores):
        raise ValueError(f"thread counts {list(threads)} must be within 1..{len(cores)} cores")
    request = {"engine_args": dict(engine_args), "threads": counts, "cores": cores,
               "plan": asdict(plan)}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "splitserve.cluster.planner.profile_run"],
                              input=json.dumps(request).encode(), stdout=subprocess.PIPE,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise LayoutProfileError(f"measuring the cost curves took over {timeout_s:.0f} s "
                                 f"(a busy machine?); choose --mode agg|disagg") from exc
    if done.returncode != 0:
        raise LayoutProfileError(f"the profiling process exited with {done.returncode} "
                                 f"(its log is above); choose --mode agg|disagg")
    curves = {}
    try:
        for line in done.stdout.decode().splitlines():
            result = json.loads(line)
            curves[int(result["threads"])] = fit_curves(
                [(int(t), float(s)) for t, s in result["prefill"]],
                [(int(n), float(s)) for n, s in result["decode"]],
                [(int(c), float(s)) for c, s in result["decode_context"]],
                int(result["short_context"]), int(result["context_batch"]),
            )._replace(fingerprint=str(result["fingerprint"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise LayoutProfileError(f"the profiling process answered {exc!r}") from exc
    if sorted(curves) != counts:
        raise LayoutProfileError(f"the profiling process measured threads {sorted(curves)} "
                                 f"of {counts}")
    logger.info("measured cost curves at %s threads in %.1f s: %s", counts,
                time.monotonic() - start, curves)
    return curves


class ProfileCache:
    """The JSON file of measured curves, {"version", "entries": {key: entry}}. A missing,
    unreadable or foreign file is an empty cache; writes replace the file atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the profile cache %s: %s", self.path, exc)
            return {}
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            return {}
        entries = data.get("entries")
        return entries if isinstance(entries, dict) else {}

    def get(self, key: ProfileKey) -> CostCurves | None:
        entry = self.load().get(key.cache_id)
        try:
            return CostCurves(Quadratic(*map(float, entry["prefill"])),  # type: ignore[index]
                              Quadratic(*map(float, entry["decode"])),  # type: ignore[index]
                              float(entry["decode_per_context_s"]),  # type: ignore[index]
                              str(entry["fingerprint"]))  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None  # absent or malformed: measure again

    def put(self, found: Mapping[ProfileKey, CostCurves]) -> None:
        entries = self.load()
        for key, curves in found.items():
            entries[key.cache_id] = {"key": asdict(key), "prefill": list(curves.prefill),
                                     "decode": list(curves.decode),
                                     "decode_per_context_s": curves.decode_per_context_s,
                                     "fingerprint": curves.fingerprint,
                                     "measured_at": time.time()}
        self._write(entries)

    def drop(self, key: ProfileKey) -> int:
        """Removes the entries of `key` at every thread count; how many there were."""
        entries = self.load()
        doomed = [cache_id for cache_id, entry in entries.items()
                  if isinstance(entry, dict) and isinstance(entry.get("key"), dict)
                  and {**entry["key"], "threads": key.threads} == asdict(key)]
        for cache_id in doomed:
            del entries[cache_id]
        if doomed:
            self._write(entries)
        return len(doomed)

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # NOTE: a temporary file renamed over the old one: a reader (another server
        # starting) sees the whole old file or the whole new one, never half of either.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".layout_profiles.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1)
        os.replace(tmp, self.path)


def cached_only(engine_args: Mapping[str, Any], threads: int, *,
                cache_path: Path | None = None) -> CostCurves | None:
    """The curves cached for a worker with `engine_args` at `threads`; None when none
    are (nothing is measured)."""
    return ProfileCache(cache_path or default_cache_path()).get(
        profile_key(engine_args, threads))


def cached_curves(engine_args: Mapping[str, Any], threads: Sequence[int], *,
                  cache_path: Path | None = None, plan: ProfilePlan = ProfilePlan(),
                  timeout_s: float = PROFILE_TIMEOUT_S) -> dict[int, CostCurves]:
    """Curves at each thread count: from the cache, measuring (and caching) only the
    counts it lacks."""
    cache = ProfileCache(cache_path or default_cache_path())
    base = profile_key(engine_args, 0)
    keys = {t: replace(base, threads=t) for t in sorted(set(threads))}
    found = {t: cache.get(key) for t, key in keys.items()}
    curves = {t: c for t, c in found.items() if c is not None}
    missing = [t for t in keys if t not in curves]
    if missing:
        logger.info("measuring cost curves at %s threads for --mode auto (cached in %s)",
                    missing, cache.path)
        measured = measure_curves(engine_args, missing, plan=plan, timeout_s=timeout_s)
        try:
            cache.put({keys[t]: measured[t] for t in missing})
        except OSError as exc:  # a read-only home: measured again next start, no more
            logger.warning("cannot write the profile cache %s: %s", cache.path, exc)
        curves.update(measured)
    return curves
