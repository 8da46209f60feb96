"""--mode auto's cost curves: measured on the real default model in a child process (a
short plan), cached by a key read without torch with the measured engine's fingerprint,
read back without measuring, measured again when the key changes, dropped when the
workers run another engine; failures are typed and bounded by a deadline."""
from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from splitserve.cluster.planner import profile
from splitserve.cluster.planner.auto_layout import ResolvedLayout, check_measured_engine
from splitserve.cluster.planner.layout import LayoutChoice, Shape
from splitserve.cluster.planner.profile_run import measure_decode
from splitserve.cluster.planner.profile import (CostCurves, ProfileCache, ProfilePlan,
                                                cached_curves, fit_curves, measure_curves,
                                                profile_key)
from splitserve.cluster.router.cost_model import Quadratic
from splitserve.config import EngineConfig, ServeConfig
from splitserve.engine.engine import LLMEngine
from splitserve.errors import LayoutProfileError

SHORT = ProfilePlan(prefill_tokens=(32, 128, 256), prefill_repeats=1,
                    decode_batches=(1, 2, 4), decode_steps=2)
# Where a test reads the context's cost: each size's fastest of 8 steps a pass, not 2.
# With 2, and once with 4, a busy CI machine read the ~1 ms that a 254-token context adds
# to a step of 4 sequences as nothing.
STEADY = replace(SHORT, decode_steps=8)
ARGS = ServeConfig(max_model_len=512).engine_args()  # the default model, as served


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The engine a 1-thread worker of ARGS runs (what the profiling child measures)."""
    args = {k: v for k, v in ARGS.items() if k != "num_threads"}
    model = args.pop("model", None)
    assert model is None or isinstance(model, str)
    return LLMEngine(EngineConfig.from_kwargs(model, **args, num_threads=1))


def test_curves_are_measured_once_then_read_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> None:
    path = tmp_path / "profiles.json"
    first = cached_curves(ARGS, [1], cache_path=path, plan=STEADY)[1]
    # Measured: costs grow with the prompt and with the batch, none is free.
    assert 0 < first.prefill(32) < first.prefill(128) < first.prefill(256) < 10
    assert 0 < first.decode(1) <= first.decode(4) < 2
    # A step reads every token of its context: a step of 4 sequences after ~500-token
    # prompts costs more than after 16 (SHORT caps decode_context_tokens at max_model_len).
    assert 0 < first.decode_per_context_s < first.decode(1) / 100
    # The entry names the engine measured: the one a worker of these settings runs.
    assert first.fingerprint == engine.fingerprint
    key = profile_key(ARGS, 1)
    [entry] = json.loads(path.read_text())["entries"].values()
    assert entry["key"] == {**json.loads(key.cache_id), "threads": 1}
    assert entry["fingerprint"] == engine.fingerprint
    assert entry["decode_per_context_s"] == first.decode_per_context_s

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("measured although the cache holds the key")

    monkeypatch.setattr(profile, "measure_curves", refuse)
    assert cached_curves(ARGS, [1], cache_path=path) == {1: first}

    calls: list[list[int]] = []
    other = CostCurves(Quadratic(0.1, 0.002, 0.0), Quadratic(0.03, 0.001, 0.0))

    def fake(engine_args: Mapping[str, Any], threads: Sequence[int],
             **kwargs: Any) -> dict[int, CostCurves]:
        calls.append(list(threads))
        return {t: other for t in threads}

    monkeypatch.setattr(profile, "measure_curves", fake)
    monkeypatch.setattr(profile, "cpu_model", lambda: "Another CPU")
    assert cached_curves(ARGS, [1], cache_path=path) == {1: other}  # a new key: measured
    assert calls == [[1]] and len(ProfileCache(path).load()) == 2
    assert cached_curves(ARGS, [1, 2], cache_path=path) == {1: other, 2: other}
    assert calls == [[1], [2]]  # only the count it lacked
    # Other settings are other keys too.
    for change in ({"dtype": "float32"}, {"batch_invariant": False}, {"block_size": 32},
                   {"quantization": "int8"}):
        assert profile_key({**ARGS, **change}, 1) != key, change
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "avx2")  # the kernels capped at another ISA
    assert profile_key(ARGS, 1) != key
    monkeypatch.delenv("SPLITSERVE_CPU_ISA")
    # And other engine code (a faster kernel) is another key: its curves are measured anew.
    assert key.code == profile.engine_code_digest() and len(key.code) == 16
    assert ProfileCache(path).get(replace(key, code="0" * 16)) is None


def test_a_small_step_time_budget_still_measures_whole_decode_batches() -> None:
    """1 ms fits no prompt: each step admits 16 prompt tokens, so a batch of 32 prompts
    joins over 32 steps; the first ones must still be decoding when the last arrives."""
    plan = replace(SHORT, decode_batches=(1, 8, 32))
    [curves] = measure_curves({**ARGS, "max_step_ms": 1.0}, [1], plan=plan).values()
    assert 0 < curves.decode(1) <= curves.decode(32) < 2
    assert profile_key({**ARGS, "max_step_ms": 1.0}, 1) != profile_key(ARGS, 1)


def test_the_cpu_key_tells_apart_one_model_with_other_isas(tmp_path: Path) -> None:
    """A Zen 4 VM with its AVX-512 hidden is named like one that shows it, and runs the
    exact kernels' AVX2 path at a fraction of the speed: another key."""
    def cpuinfo(flags: str) -> str:
        path = tmp_path / f"cpuinfo-{len(flags)}"
        block = (f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                 f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n\n")
        path.write_text(block + block.replace("processor\t: 0", "processor\t: 1"))
        return str(path)

    wide = profile.cpu_model(cpuinfo("avx2 fma avx512f avx512bw avx512_bf16"))
    narrow = profile.cpu_model(cpuinfo("avx2 fma"))
    assert wide == "AMD EPYC (family 25 model 17; avx2 fma avx512f avx512_bf16)"
    assert narrow == "AMD EPYC (family 25 model 17; avx2 fma)"
    assert profile.cpu_model(str(tmp_path / "missing")) != ""  # the platform's answer
    key = profile.ProfileKey("w", "{}", 1, wide, "{}")
    assert key.cache_id != replace(key, cpu_model=narrow).cache_id


def test_the_code_digest_follows_the_engine_sources(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "splitserve"
    (root / "engine").mkdir(parents=True)
    (root / "model" / "kernels" / "csrc").mkdir(parents=True)
    (root / "engine" / "runner.py").write_text("a = 1\n")
    kernel = root / "model" / "kernels" / "csrc" / "attention.cpp"
    kernel.write_text("// v1\n")
    monkeypatch.setattr(profile, "__file__", str(root / "cluster" / "planner" / "profile.py"))
    first = profile.engine_code_digest()
    kernel.write_text("// v2\n")
    assert profile.engine_code_digest() != first
    kernel.write_text("// v1\n")
    assert profile.engine_code_digest() == first


def test_a_broken_cache_file_is_an_empty_cache(tmp_path: Path) -> None:
    path = tmp_path / "profiles.json"
    path.write_text("{not json")
    key = profile.ProfileKey("w", "{}", 1, "cpu", "{}")
    cache = ProfileCache(path)
    assert cache.load() == {} and cache.get(key) is None
    curves = CostCurves(Quadratic(0.1, 0.002, 1e-7), Quadratic(0.02, 0.001, 0.0), 3e-6, "f")
    cache.put({key: curves})
    assert cache.get(key) == curves and cache.get(replace(key, threads=2)) is None


def test_curves_of_another_engine_are_dropped_once_the_workers_tell(tmp_path: Path) -> None:
    """The workers' fingerprint against the entries the layout came from: equal, nothing
    happens; another (the kernels no longer build here, say), that key's entries go at
    every thread count, another key's stay."""
    path = tmp_path / "profiles.json"
    config = ServeConfig(mode="agg", profile_cache=str(path))
    base = profile_key(config.engine_args(), 0)
    other = replace(base, cpu_model="Another CPU")
    curves = CostCurves(Quadratic(0.1, 0.002, 0.0), Quadratic(0.02, 0.001, 0.0), 0.0, "f1")
    cache = ProfileCache(path)
    cache.put({replace(base, threads=1): curves, replace(base, threads=2): curves,
               replace(other, threads=1): curves})
    resolved = ResolvedLayout(config, LayoutChoice(Shape.AGG, 0, 1, None, "never", "given"),
                              measured=frozenset({"f1"}))
    assert check_measured_engine(config, resolved, "f1")
    assert check_measured_engine(config, resolved, None)  # no worker told
    assert check_measured_engine(config, resolved._replace(measured=frozenset()), "f2")
    assert len(cache.load()) == 3
    assert not check_measured_engine(config, resolved, "f2")
    assert [e["key"]["cpu_model"] for e in cache.load().values()] == ["Another CPU"]


def test_timings_that_fit_no_curve_are_refused() -> None:
    with pytest.raises(LayoutProfileError, match="too busy"):
        fit_curves([(128, 1.0), (512, 0.5), (1024, 0.1)], [(1, 0.02), (8, 0.03), (32, 0.05)])
    # A step descheduled for half a second among 15 ms ones: the fastest of each size.
    good = fit_curves([(128, 0.1), (512, 0.4), (1024, 0.9), (128, 0.6)],
                      [(1, 0.6), (1, 0.015), (8, 0.03), (32, 0.06), (8, 0.5), (32, 0.07)])
    assert good.prefill(128) == pytest.approx(0.1) and good.prefill(1024) == pytest.approx(0.9)
    assert good.decode(1) == pytest.approx(0.015, rel=0.2)
    assert good.decode(32) == pytest.approx(0.06, rel=0.1)
    with pytest.raises(LayoutProfileError, match="3 sizes"):  # a line needs 3 sizes here
        fit_curves([(128, 0.1), (512, 0.4), (1024, 0.9)], [(1, 0.02), (8, 0.03), (1, 0.02)])


def test_the_step_cost_per_context_token_comes_from_the_long_context_steps() -> None:
    """(context, seconds) of batch-1 steps after a long prompt, against the fitted batch-1
    step at the decode samples' short context: the fastest long step's excess per token."""
    prefill = [(32, 0.031), (128, 0.068), (256, 0.141)]
    decode = [(1, 0.007), (8, 0.017), (32, 0.05)]
    curves = fit_curves(prefill, decode, [(1026, 0.0140), (1026, 0.0131)], short_context=18)
    assert curves.decode_per_context_s == pytest.approx((0.0131 - curves.decode(1)) / 1008)
    assert fit_curves(prefill, decode).decode_per_context_s == 0.0  # none measured
    # A long step measured faster than a short one (noise): no negative cost
    assert fit_curves(prefill, decode, [(1026, 0.005)], 18).decode_per_context_s == 0.0
    # Over a batch (its KV out of cache): the excess over that batch's step, per sequence
    four = fit_curves(prefill, decode, [(1026, 0.040)], 18, context_batch=4)
    assert four.decode_per_context_s == pytest.approx((0.040 - four.decode(4)) / (4 * 1008))
    # Short steps measured beside the long ones: the excess over their fastest, not over
    # the fit (a noisy batch of the fit had hidden a 1 ms excess: CI 2026-12-06)
    paired = fit_curves(prefill, decode, [(18, 0.0310), (1026, 0.0330), (18, 0.0300)], 18,
                        context_batch=4)
    assert paired.decode_per_context_s == pytest.approx(0.003 / (4 * 1008))


def test_a_flat_decode_step_fits_through_its_noise() -> None:
    prefill = [(32, 0.031), (128, 0.068), (256, 0.141)]
    # Batches 1-4 on AMX tiles (CI, 1 thread): one step reads the weights whatever the
    # batch; batch 4 came out faster than batch 1.
    curves = fit_curves(prefill, [(1, 0.0299), (1, 0.0250), (2, 0.0266), (2, 0.0262),
                                  (4, 0.0214), (4, 0.0247)])
    assert 0.025 <= curves.decode(1) <= curves.decode(4) <= 0.027
    flat = fit_curves(prefill, [(1, 0.03), (2, 0.03), (4, 0.029)])
    assert flat.decode.b == 0.0 and flat.decode(64) == pytest.approx(0.03)
    with pytest.raises(LayoutProfileError, match="too busy"):  # 30% under: not noise
        fit_curves(prefill, [(1, 0.03), (2, 0.031), (4, 0.021)])


def test_measuring_has_a_deadline() -> None:
    with pytest.raises(LayoutProfileError, match="took over 0 s"):
        measure_curves(ARGS, [1], plan=SHORT, timeout_s=0.3)
    with pytest.raises(ValueError, match="thread counts"):
        measure_curves(ARGS, [0], plan=SHORT)


def test_decode_passes_alternate_so_a_slow_phase_lands_on_other_batches(
        engine: LLMEngine) -> None:
    """CI once saw batch 1 at 30-32 ms, batch 2 at 29, batch 4 at 22 in one ascending pass
    (a slow phase of the VM over its first ~0.3 s): no curve fits. The second pass runs
    the batches descending, so the phase would have to return at its end to slow batch 1
    again; each batch's fastest step counts."""
    samples = measure_decode(engine, random.Random(0), [1, 2, 4], SHORT)
    assert [n for n, _ in samples] == [1, 1, 2, 2, 4, 4, 4, 4, 2, 2, 1, 1]
    assert all(0 < seconds < 2 for _, seconds in samples)
    assert not engine.has_unfinished  # every pass's sequences aborted
    prefill = [(32, 0.031), (128, 0.068), (256, 0.141)]
    slow_first = [(1, 0.0303), (1, 0.0318), (2, 0.0286), (2, 0.0292), (4, 0.0222), (4, 0.022)]
    with pytest.raises(LayoutProfileError, match="too busy"):
        fit_curves(prefill, slow_first)
    second = [(4, 0.0223), (4, 0.0221), (2, 0.0212), (2, 0.0215), (1, 0.0210), (1, 0.0211)]
    curves = fit_curves(prefill, slow_first + second)
    assert 0.020 <= curves.decode(1) <= curves.decode(4) <= 0.023
