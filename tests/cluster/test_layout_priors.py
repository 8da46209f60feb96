"""An explicit layout's router priors (auto_layout._priors): its decode workers' curves
from the profile cache when an earlier start measured them, at the thread count its
workers will run; nothing measured; none on a Ray cluster or under the planner. And the
real cache file read as `splitserve serve` reads it."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from splitserve.cluster.planner.auto_layout import resolve_layout, router_costs
from splitserve.cluster.planner.profile import CostCurves, ProfileCache, profile_key
from splitserve.cluster.router.cost_model import Quadratic
from splitserve.cluster.runtime import split_cores
from splitserve.config import ServeConfig

ONE = CostCurves(Quadratic(0.016, 0.003, 7e-7), Quadratic(0.013, 0.004, 0.0), 5e-7)
TWO = CostCurves(Quadratic(0.019, 0.0014, 5e-7), Quadratic(0.008, 0.0023, 0.0), 5.6e-7)


def _never_measure(*_: Any) -> Mapping[int, CostCurves]:
    raise AssertionError("an explicit layout measures nothing")


@pytest.mark.parametrize("config, threads", [
    (ServeConfig(mode="disagg", disagg_policy="auto"), 1),  # 1P+1D: a core each
    (ServeConfig(mode="disagg"), 1),
    (ServeConfig(mode="agg", decode=1), 2),  # one worker on both cores
    (ServeConfig(mode="agg", decode=2), 1),
    (ServeConfig(mode="disagg", threads_per_worker=2), 2),
    (ServeConfig(mode="disagg", worker_cores=[[0], [1]]), 1),
    (ServeConfig(mode="disagg", prefill=1, decode=2), 1),  # fewer cores than workers
])
def test_the_cached_curves_of_its_decode_workers_become_the_priors(
        config: ServeConfig, threads: int) -> None:
    asked: list[int] = []

    def cached(engine_args: Mapping[str, Any], count: int,
               cache: Path | None) -> CostCurves | None:
        asked.append(count)
        return {1: ONE, 2: TWO}.get(count)
    resolved = resolve_layout(config, _never_measure, cores=2, cached=cached)
    assert asked == [threads] and resolved.curves is not None
    want = {1: ONE, 2: TWO}[threads]
    assert resolved.curves.prefill == want.prefill and resolved.curves.decode == want.decode
    assert resolved.curves.context_tokens > 0  # at the hint's mean context
    priors = router_costs(resolved.curves)
    assert priors.prefill_per_token_s == want.prefill.b  # not the constant default
    assert priors.prefill_per_token_s != router_costs(None).prefill_per_token_s


@pytest.mark.parametrize("config", [
    ServeConfig(mode="disagg", runtime="ray"),  # the workers run on other machines
    ServeConfig(planner="on", slo_ttft_ms=1000, slo_tpot_ms=50),  # it resizes them
])
def test_no_priors_where_the_cache_does_not_describe_the_workers(config: ServeConfig) -> None:
    asked: list[int] = []
    resolved = resolve_layout(config, _never_measure, cores=2,
                              cached=lambda _a, count, _c: asked.append(count))
    assert resolved.curves is None and asked == []


def test_the_profile_cache_file_is_read_and_nothing_measured(tmp_path: Path) -> None:
    """The real lookup: a cache file holding this model's 1-thread curves (written as a
    --mode auto start writes it) gives an explicit 1P+1D layout its priors; an empty or
    missing file gives none."""
    path = tmp_path / "profiles.json"
    config = ServeConfig(mode="disagg", disagg_policy="auto", profile_cache=str(path))
    assert resolve_layout(config, _never_measure, cores=2).curves is None  # no file
    ProfileCache(path).put({profile_key(config.engine_args(), 1): ONE})
    resolved = resolve_layout(config, _never_measure, cores=2)
    assert resolved.curves is not None and resolved.curves.prefill == ONE.prefill
    ProfileCache(path).put({profile_key(config.engine_args(), 2): TWO})
    agg1 = resolve_layout(ServeConfig(mode="agg", profile_cache=str(path)), _never_measure,
                          cores=2)
    assert agg1.curves is not None and agg1.curves.decode == TWO.decode


@pytest.mark.parametrize("cores", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("prefill, decode", [(1, 1), (1, 2), (2, 3), (0, 1), (0, 3)])
def test_the_width_asked_is_the_one_the_runtime_gives_a_decode_worker(
        cores: int, prefill: int, decode: int) -> None:
    """_priors sizes the decode workers as runtime.split_cores splits the cores (the
    planner may not import the runtime: tests/test_layering.py)."""
    config = (ServeConfig(mode="agg", decode=decode) if prefill == 0
              else ServeConfig(mode="disagg", prefill=prefill, decode=decode))
    asked: list[int] = []
    resolve_layout(config, _never_measure, cores=cores,
                   cached=lambda _a, count, _c: asked.append(count))
    counts = [decode] if prefill == 0 else [prefill, decode]
    assert asked == [len(split_cores(list(range(cores)), counts)[-1][-1])]
