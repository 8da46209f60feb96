"""`splitserve serve --mode auto` (the default): the ServeConfig with the layout chosen
for this machine (layout.py, from curves measured by profile.py) in place of "auto", and
the choice itself for the startup log, /metrics (`splitserve_layout_info`) and
/admin/health. An explicit `--mode agg|disagg` passes through unchanged (its choice says
so; disagg under --disagg-policy auto is labeled "mixed", the layout it runs).

The chosen kind's disaggregation policy replaces --disagg-policy in the ServeConfig:
"never" for agg, "always" for disagg, "auto" for mixed. A --disagg-policy other than
auto limits the kinds compared: always drops mixed, never keeps only agg. Mixed's model
assumes the router's TPOT budget at the target it was scored at: without --slo-tpot-ms
the router gets the derived one (router_tpot_slo_s).

With auto, what the operator fixed is honoured rather than second-guessed:
- pool counts (--prefill, --decode or --worker-cores): the former default, disagg with
  those counts (`--mode agg` asks for colocated workers);
- the planner (--planner advisory|on): disagg, the layout it sizes (it may still drop
  the prefill pool later);
- --runtime ray: disagg; the workers run on the Ray cluster's nodes, not on the cores
  measured here;
- --threads-per-worker T: every candidate runs T threads per worker.
When measuring fails (or passes its deadline) the former default, disagg, serves, and
the reason says why. A layout not chosen here still hands the router this machine's
curves as its priors when an earlier start measured them (the profile cache; nothing is
measured for it): a decode worker of an explicit mixed layout would otherwise judge its
local prefills by a constant prior (router_costs). Once the workers register, the launcher
checks that those curves were measured on the engine they run (check_measured_engine).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry, Info

from splitserve.cluster.planner.capacity import Curves
from splitserve.cluster.planner.layout import (LayoutChoice, Shape, SLOTarget, WorkloadHint,
                                               at_context, candidate_threads, choose_layout,
                                               default_slo)
from splitserve.cluster.planner.profile import (CostCurves, ProfileCache, cached_curves,
                                                cached_only, default_cache_path, profile_key)
from splitserve.cluster.router.cost_model import CostModelConfig
from splitserve.config import ServeConfig
from splitserve.errors import LayoutProfileError, ModelLoadError

logger = logging.getLogger("splitserve.layout")

# (engine args, thread counts, cache file or None) -> curves at each count
CurvesSource = Callable[[Mapping[str, Any], Sequence[int], Path | None],
                        Mapping[int, CostCurves]]
# (engine args, thread count, cache file or None) -> the curves cached there, measuring none
CachedSource = Callable[[Mapping[str, Any], int, Path | None], CostCurves | None]
# --disagg-policy -> the kinds --mode auto compares (the default, auto: all of them)
_KINDS = {"auto": tuple(Shape), "always": (Shape.AGG, Shape.DISAGG), "never": (Shape.AGG,)}


class ResolvedLayout(NamedTuple):
    config: ServeConfig  # mode "agg" or "disagg", with the pool counts to start
    choice: LayoutChoice
    # One worker's measured curves at the chosen width, at the hint's mean context (None:
    # nothing measured); the router's priors (router_costs).
    curves: Curves | None = None
    # The model fingerprints of the engines measured for the curves used ("": unknown).
    measured: frozenset[str] = frozenset()


def _measured(engine_args: Mapping[str, Any], threads: Sequence[int],
              cache_path: Path | None) -> Mapping[int, CostCurves]:
    return cached_curves(engine_args, threads, cache_path=cache_path)


def _cached(engine_args: Mapping[str, Any], threads: int,
            cache_path: Path | None) -> CostCurves | None:
    return cached_only(engine_args, threads, cache_path=cache_path)


def resolve_layout(config: ServeConfig, curves: CurvesSource = _measured,
                   cores: int | None = None, cached: CachedSource = _cached) -> ResolvedLayout:
    """The layout to start (see the module docstring) and why; logs one INFO line.
    `cores`: None, this process's. Blocks while measuring (about a minute on 2 cores;
    profile.PROFILE_TIMEOUT_S at most): run it off the event loop."""
    resolved = _resolve(config, curves, cores)
    if resolved.curves is None:
        found = _priors(resolved.config, cached, cores)
        if found is not None:
            hint = WorkloadHint(*config.workload_tokens)
            resolved = resolved._replace(
                curves=at_context({0: _curves(found, config)}, hint)[0],
                measured=frozenset({found.fingerprint}))
    logger.info("layout: %s, --disagg-policy %s (%s)", resolved.choice.label,
                resolved.choice.disagg_policy, resolved.choice.reason)
    return resolved


def router_tpot_slo_s(config: ServeConfig, choice: LayoutChoice) -> float | None:
    """The router's TPOT budget: --slo-tpot-ms, else for a chosen mixed layout the target
    it was scored at (its local prefills were modeled within it), else None."""
    if config.slo_tpot_ms:
        return config.slo_tpot_ms / 1000
    if choice.shape is Shape.MIXED and choice.candidates and choice.slo is not None:
        return choice.slo.tpot_s
    return None


def router_costs(curves: Curves | None) -> CostModelConfig:
    """The router's cost-model priors: a worker's measured curves where there are some,
    else the defaults. A worker's prediction uses its own samples once it has enough, else
    those pooled over the workers of its width (a prefill worker borrowing cores is not
    one), else these: without them a decode worker that seldom prefills alone would judge
    its local prefills by a constant (1,500 tokens/s, ~8x an AVX2 core's)."""
    if curves is None:
        return CostModelConfig()
    a, b, c = curves.prefill
    one, per_seq = curves.step_s(1), (curves.step_s(8) - curves.step_s(1)) / 7
    return CostModelConfig(
        prefill_fixed_s=max(a, 0.0), prefill_per_token_s=max(b, 0.0),
        prefill_per_token2_s=max(c, 0.0), decode_step_base_s=max(one - per_seq, 0.0),
        decode_step_per_seq_s=max(per_seq, 0.0))


def _resolve(config: ServeConfig, curves: CurvesSource, cores: int | None) -> ResolvedLayout:
    if config.mode != "auto":
        return _given(config, f"--mode {config.mode} given")
    if config.prefill is not None or config.decode is not None or config.worker_cores:
        return _given(replace(config, mode="disagg"),
                      "pool counts given (--prefill/--decode/--worker-cores) without --mode: "
                      "disagg, the former default (--mode agg for colocated workers)")
    if config.planner != "off":
        return _given(replace(config, mode="disagg"),
                      f"--planner {config.planner} sizes a disaggregated layout (it may "
                      f"drop the prefill pool later)")
    if config.runtime != "local":
        return _given(replace(config, mode="disagg"),
                      f"--runtime {config.runtime}: workers run on the cluster's nodes, not "
                      f"on this machine's cores; disagg, the former default")
    cores = cores or len(os.sched_getaffinity(0))
    threads = candidate_threads(cores, config.threads_per_worker)
    cache = Path(config.profile_cache) if config.profile_cache else None
    try:
        found = curves(config.engine_args(), threads, cache)
    except LayoutProfileError as exc:
        logger.warning("--mode auto could not measure this machine: %s", exc)
        return _given(replace(config, mode="disagg"),
                      f"measuring the cost curves failed ({exc}): disagg, the former default")
    by_threads = {t: _curves(c, config) for t, c in found.items()}
    hint = WorkloadHint(*config.workload_tokens)
    kinds = _KINDS[config.disagg_policy]
    choice = choose_layout(by_threads, hint, _slo(config, by_threads, hint), cores,
                           threads_per_worker=config.threads_per_worker, kinds=kinds,
                           borrow=config.prefill_borrows_cores,
                           pace_s=config.decode_pace_s)
    if bool(config.slo_ttft_ms) != bool(config.slo_tpot_ms):
        missing = "--slo-tpot-ms" if config.slo_ttft_ms else "--slo-ttft-ms"
        choice = replace(choice, reason=f"{choice.reason}; {missing} not given: derived "
                                        f"from the measured costs")
    if config.disagg_policy != "auto":
        choice = replace(choice, reason=f"{choice.reason}; --disagg-policy "
                                        f"{config.disagg_policy} given: only "
                                        f"{' and '.join(k.value for k in kinds)} compared")
    width = at_context(by_threads, hint)[choice.threads_per_worker or min(by_threads)]
    return ResolvedLayout(replace(config, mode=choice.layout.value, prefill=choice.num_prefill,
                                  decode=choice.num_decode,
                                  disagg_policy=choice.disagg_policy), choice, width,
                          frozenset(c.fingerprint for c in found.values()))


def check_measured_engine(config: ServeConfig, resolved: ResolvedLayout,
                          fingerprint: str | None) -> bool:
    """Once the workers registered (`fingerprint`: their model fingerprint, None when none
    told): whether the curves behind the layout and the router's priors were measured on
    the engine they run. When not (the exact kernels stopped building here, say, and the
    engine fell back to the fast path), that key's cache entries are dropped, so the next
    start measures again, and a warning says so."""
    stale = {f for f in resolved.measured if f and f != fingerprint}
    if fingerprint is None or not stale:
        return True
    cache = ProfileCache(Path(config.profile_cache) if config.profile_cache
                         else default_cache_path())
    try:
        dropped = cache.drop(profile_key(config.engine_args(), 0))
    except (ModelLoadError, OSError, ValueError) as exc:
        dropped, why = 0, f" (not dropped: {exc})"
    else:
        why = ""
    logger.warning("the layout's cost curves were measured on another engine (fingerprint "
                   "%s) than the workers run (%s): %d cache entries dropped%s; the next "
                   "start measures again", ", ".join(sorted(stale)), fingerprint, dropped,
                   why)
    return False



def _curves(found: CostCurves, config: ServeConfig) -> Curves:
    return Curves(found.prefill, found.decode, config.max_num_seqs,
                  decode_per_context_s=found.decode_per_context_s)


def _priors(config: ServeConfig, cached: CachedSource, cores: int | None) -> CostCurves | None:
    """A layout not chosen here: its decode workers' cached curves, as specs.worker_specs
    sizes them (their cores, or --threads-per-worker); None on a Ray cluster (other
    machines), under the planner (it resizes the workers), or when none are cached."""
    if config.runtime != "local" or config.planner != "off":
        return None
    if config.worker_cores is not None:
        threads = len(config.worker_cores[-1])  # decode workers are listed last
    else:
        # runtime.split_cores: cores // workers each, the rest to the first ones (the
        # decode workers are the last); one each when there are fewer cores than workers
        num_prefill, num_decode = config.pool_sizes
        workers = num_decode + (0 if config.mode == "agg" else num_prefill)
        threads = max(1, (cores or len(os.sched_getaffinity(0))) // workers)
    cache = Path(config.profile_cache) if config.profile_cache else None
    try:
        return cached(config.engine_args(), config.threads_per_worker or threads, cache)
    except (ModelLoadError, OSError, ValueError) as exc:  # the workers will say it, in full
        logger.debug("no cached curves for the router's priors: %s", exc)
        return None


def _slo(config: ServeConfig, curves: Mapping[int, Curves],
         hint: WorkloadHint) -> SLOTarget | None:
    """The SLO flags; one missing is derived from the measured costs (both: None)."""
    if not (config.slo_ttft_ms or config.slo_tpot_ms):
        return None
    derived = default_slo(curves, hint)
    return SLOTarget(config.slo_ttft_ms / 1000 if config.slo_ttft_ms else derived.ttft_s,
                     config.slo_tpot_ms / 1000 if config.slo_tpot_ms else derived.tpot_s)


def _given(config: ServeConfig, reason: str) -> ResolvedLayout:
    """An explicit layout's choice; its counts as the launcher will start them."""
    num_prefill, num_decode = config.pool_sizes
    shape = Shape.of(config.mode, config.disagg_policy)
    return ResolvedLayout(config, LayoutChoice(
        shape, 0 if shape is Shape.AGG else num_prefill, num_decode,
        config.threads_per_worker,
        "never" if shape is Shape.AGG else config.disagg_policy, reason))


def publish_layout(registry: CollectorRegistry, choice: LayoutChoice) -> None:
    """`splitserve_layout_info{layout, prefill, decode, reason} 1` in `registry`; layout
    is agg, disagg or mixed."""
    Info("splitserve_layout", "The worker layout serving and why it was chosen (--mode)",
         registry=registry).info({"layout": choice.shape.value,
                                  "prefill": str(choice.num_prefill),
                                  "decode": str(choice.num_decode), "reason": choice.reason})
