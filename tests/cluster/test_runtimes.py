"""The Runtime interface's small parts: which found worker may be adopted, and the local
runtime's answer to adoption (its workers die with the frontend: none to find)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from splitserve.cluster.protocol import Role
from splitserve.cluster.runtime import LocalRuntime, get_runtime
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import ServeConfig


def _spec(**kw: object) -> WorkerSpec:
    base = WorkerSpec(role=Role.DECODE, index=0, epoch=1, frontend_address="tcp://10.0.0.1:5",
                      engine_args={"model": None, "max_num_seqs": 8})
    return replace(base, **kw)  # type: ignore[arg-type]


def test_a_found_worker_is_adopted_only_for_the_same_work() -> None:
    found = _spec(epoch=4, frontend_address="tcp://10.0.0.2:6", kv_host="10.0.0.3")
    assert found.same_work(_spec())  # another incarnation, frontend and node: same work
    assert not found.same_work(_spec(index=1))
    assert not found.same_work(_spec(role=Role.PREFILL))
    assert not found.same_work(_spec(engine_args={"model": None, "max_num_seqs": 16}))
    assert not found.same_work(_spec(kv_transport="shm"))


def test_the_local_runtime_finds_nothing_to_adopt() -> None:
    runtime = get_runtime(ServeConfig())
    assert isinstance(runtime, LocalRuntime) and runtime.control_host == "127.0.0.1"
    assert runtime.find_workers() == []
    with pytest.raises(NotImplementedError):
        runtime.adopt_worker(_spec(), "tcp://127.0.0.1:1", None)  # type: ignore[arg-type]
    assert runtime.worker_spec(_spec()) == _spec()


def test_restarts_back_off_exponentially_up_to_a_cap() -> None:
    from splitserve.cluster.supervisor import MAX_RESTART_BACKOFF_S, restart_delay
    assert [restart_delay(1.0, n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert restart_delay(1.0, 10) == restart_delay(1.0, 10_000) == MAX_RESTART_BACKOFF_S
    assert restart_delay(0.0, 3) == 0.0


def test_local_workers_run_nicer_than_the_frontend_and_ray_actors_do_not() -> None:
    from splitserve.cluster.specs import worker_specs
    [spec] = worker_specs(ServeConfig(mode="agg", decode=1), "tcp://127.0.0.1:1")
    assert spec.nice == 5 and WorkerSpec.from_json(spec.to_json()).nice == 5
    [spec] = worker_specs(ServeConfig(mode="agg", decode=1, worker_nice=0), "tcp://127.0.0.1:1")
    assert spec.nice == 0
    for bad in (-1, 20):
        with pytest.raises(ValueError, match="worker_nice"):
            ServeConfig(worker_nice=bad)
    # A Ray actor's process is Ray's (and the frontend is on another node, or not): as is.
    from types import SimpleNamespace

    from splitserve.cluster.runtime.ray import RayRuntime
    from splitserve.config import RayConfig
    runtime = SimpleNamespace(config=RayConfig())
    on_ray = RayRuntime.worker_spec(runtime, _spec(nice=5))  # type: ignore[arg-type]
    assert on_ray.nice == 0


def test_threads_follow_the_setting_then_the_pinned_cores() -> None:
    assert _spec().num_threads is None
    assert _spec(cpu_cores=(0, 1)).num_threads == 2
    assert _spec(cpu_cores=(0, 1), engine_args={"num_threads": 1}).num_threads == 1


def test_workers_the_planner_adds_do_not_oversubscribe_the_cores() -> None:
    """The planner's budget shares the cores: every worker is sized for it at the start,
    and a worker added onto cores others use gets what they leave (at least one)."""
    import os

    from splitserve.cluster.launcher import Cluster
    from splitserve.cluster.runtime import WorkerHandle
    from splitserve.cluster.specs import worker_specs
    cores = len(os.sched_getaffinity(0))
    config = ServeConfig(mode="disagg", prefill=0, decode=1, planner="on",
                         planner_max_workers=cores, slo_ttft_ms=1000, slo_tpot_ms=100)
    [spec] = worker_specs(config, "tcp://127.0.0.1:1")
    assert spec.num_threads == 1 and spec.cpu_cores is not None
    assert len(spec.cpu_cores) == cores
    [plain] = worker_specs(ServeConfig(mode="agg", decode=1), "tcp://127.0.0.1:1")
    assert plain.num_threads == cores  # no planner: one thread per pinned core

    launcher = Cluster(ServeConfig())
    template = _spec(cpu_cores=(0, 1))
    launcher.handles = [WorkerHandle(template)]
    assert launcher._thread_share(template)["num_threads"] == 1  # the first uses both
    launcher.handles = [WorkerHandle(_spec(cpu_cores=(0, 1), engine_args={"num_threads": 1}))]
    assert launcher._thread_share(template)["num_threads"] == 1
    launcher.handles = [WorkerHandle(_spec(cpu_cores=(2, 3)))]
    assert launcher._thread_share(template)["num_threads"] == 2  # other cores: all its own
    fixed = _spec(cpu_cores=(0, 1), engine_args={"num_threads": 2})
    assert launcher._thread_share(fixed)["num_threads"] == 2  # --threads-per-worker wins


def test_prefill_workers_borrow_the_decode_cores_through_leases(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--prefill-borrows-cores (the default), disagg on split cores: each prefill worker
    keeps its own cores and threads and gets a helper on each core of its share of the
    decode workers' (each lent once), with that core's lease; a decode worker holds the
    leases of the cores it lends. Off when turned off, with cores or threads set by
    hand, the planner on, in agg, or on Ray."""
    import os

    from splitserve.cluster.specs import lend_cores, worker_specs
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})

    def layout(**kw: object) -> list[tuple[object, ...]]:
        kw.setdefault("prefill_borrows_cores", True)
        specs = worker_specs(ServeConfig(**kw), "tcp://127.0.0.1:1")  # type: ignore[arg-type]
        return [(s.worker_id, s.cpu_cores, s.nice, s.num_threads, s.borrowed_cores,
                 tuple(p.rsplit("-", 1)[-1] for p in s.leases)) for s in specs]

    assert layout(mode="disagg", prefill=1, decode=1) == [
        ("prefill-0", (0, 1, 2), 5, 3, (3, 4, 5), ("core3.lease", "core4.lease", "core5.lease")),
        ("decode-0", (3, 4, 5), 5, 3, (), ("core3.lease", "core4.lease", "core5.lease"))]
    assert layout(mode="disagg", prefill=2, decode=1) == [
        ("prefill-0", (0, 1), 5, 2, (4,), ("core4.lease",)),
        ("prefill-1", (2, 3), 5, 2, (5,), ("core5.lease",)),
        ("decode-0", (4, 5), 5, 2, (), ("core4.lease", "core5.lease"))]
    assert [s[4] for s in layout(mode="disagg", prefill=1, decode=2)] == [(2, 3, 4, 5), (), ()]
    specs = worker_specs(ServeConfig(mode="disagg", prefill=1, decode=1,
                                     prefill_borrows_cores=True), "tcp://127.0.0.1:1")
    assert specs[0].leases == specs[1].leases  # the same files
    assert all(p.startswith(("/dev/shm/", "/tmp/")) for p in specs[0].leases)
    plain = [("prefill-0", (0, 1, 2), 5, 3, (), ()), ("decode-0", (3, 4, 5), 5, 3, (), ())]
    assert layout(mode="disagg", prefill=1, decode=1, prefill_borrows_cores=False) == plain
    assert ServeConfig().prefill_borrows_cores  # the default
    assert layout(mode="disagg", prefill=1, decode=1, worker_cores=[[0, 1, 2], [3, 4, 5]]
                  ) == plain
    assert [s[:2] + s[3:] for s in layout(mode="disagg", prefill=1, decode=1,
                                          threads_per_worker=3)] == [
        (w, c, 3, (), ()) for w, c, *_ in plain]
    assert [s[4:] for s in layout(mode="disagg", prefill=0, decode=1, planner="on",
                                  slo_ttft_ms=1000, slo_tpot_ms=100)] == [((), ())]
    assert all(s[4:] == ((), ()) for s in layout(mode="agg", decode=2))
    assert all(s[4:] == ((), ()) for s in layout(mode="disagg", prefill=1, decode=1,
                                                  runtime="ray"))
    # With a TPOT target the lending decode worker paces its steps (0.8 x the target
    # apart while the prefill has prompts); not without one, nor with --no-pace-decode,
    # nor without lending.
    def paces(**kw: object) -> list[float | None]:
        kw.setdefault("prefill_borrows_cores", True)
        return [s.pace_s for s in worker_specs(ServeConfig(**kw),  # type: ignore[arg-type]
                                               "tcp://127.0.0.1:1")]

    assert paces(mode="disagg", prefill=1, decode=1, slo_tpot_ms=100) == [None, 0.08]
    assert paces(mode="disagg", prefill=2, decode=1, slo_tpot_ms=50) == [None, None, 0.04]
    assert paces(mode="disagg", prefill=1, decode=1) == [None, None]
    assert paces(mode="disagg", prefill=1, decode=1, slo_tpot_ms=100,
                 pace_decode=False) == [None, None]
    assert paces(mode="disagg", prefill=1, decode=1, slo_tpot_ms=100,
                 prefill_borrows_cores=False) == [None, None]
    assert paces(mode="agg", decode=2, slo_tpot_ms=100) == [None, None]
    assert ServeConfig().pace_decode  # the default
    # With fewer cores than workers, pools share cores: nothing is left to lend.
    assert lend_cores([(0,)], [(0,)]) == [()]
    assert lend_cores([(0,), (1,)], [(2,)]) == [(2,), ()]
