"""The supervisor's decisions (cluster/supervisor.py): what it makes of a worker, and what
it does about a start that never registers. The hung worker's whole path, with real
processes, is tests/faults/test_failure_table_e2e.py::test_hung_decode_worker_is_killed_...;
restarts after an exit are the rest of that file and tests/faults/test_chaos_e2e.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.worker_table import WorkerTable
from splitserve.cluster.planner.load_time import LoadTimes
from splitserve.cluster.protocol import Role
from splitserve.cluster.runtime import WorkerHandle
from splitserve.cluster.supervisor import Supervisor, Verdict, verdict
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.config import DeadlineConfig, ServeConfig

HEARTBEAT, START = 5.0, 60.0


def _verdict(**kw: Any) -> Verdict:
    state = dict(alive=True, registered_once=True, removed_since=None, started_at=0.0,
                 now=100.0, heartbeat_timeout_s=HEARTBEAT, start_timeout_s=START)
    return verdict(**{**state, **kw})  # type: ignore[arg-type]


def test_the_verdicts() -> None:
    assert _verdict() is Verdict.RUNNING
    assert _verdict(alive=False) is Verdict.EXITED
    assert _verdict(alive=False, registered_once=False) is Verdict.EXITED
    # Removed by the frontend: a heartbeat deadline to exit by itself (told when it speaks).
    assert _verdict(removed_since=96.0) is Verdict.RUNNING
    assert _verdict(removed_since=95.0) is Verdict.HUNG
    # Starting: the start deadline, counted from when it was started here.
    assert _verdict(registered_once=False, started_at=41.0) is Verdict.RUNNING
    assert _verdict(registered_once=False, started_at=39.0) is Verdict.STUCK_STARTING
    assert _verdict(registered_once=False, started_at=None) is Verdict.RUNNING  # adopted
    assert _verdict(started_at=0.0) is Verdict.RUNNING  # registered: no start deadline


@dataclass
class _Runtime:
    """Processes as flags: which are alive, which were stopped and how."""
    alive: set[bytes] = field(default_factory=set)
    stops: list[tuple[str, float]] = field(default_factory=list)
    starts: list[str] = field(default_factory=list)

    def is_alive(self, handle: WorkerHandle) -> bool:
        return handle.spec.identity in self.alive

    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        self.alive.discard(handle.spec.identity)
        self.stops.append((handle.spec.worker_id, timeout_s))

    def start_worker(self, spec: WorkerSpec, secret: object) -> WorkerHandle:
        self.alive.add(spec.identity)
        self.starts.append(spec.identity.decode())
        return WorkerHandle(spec, 0)


@dataclass
class _Link:
    revoked: list[bytes] = field(default_factory=list)

    def revoke(self, identity: bytes) -> None:
        self.revoked.append(identity)

    def enroll(self, identity: bytes) -> None:
        return None


@dataclass
class _Dispatcher:
    table: WorkerTable = field(default_factory=WorkerTable)
    link: _Link = field(default_factory=_Link)
    metrics: Metrics = field(default_factory=Metrics)
    dead: list[bytes] = field(default_factory=list)

    def mark_dead(self, identity: bytes, why: str) -> None:
        self.dead.append(identity)


def _supervised(registered: bool, restart: bool = True
                ) -> tuple[Supervisor, _Runtime, _Dispatcher, WorkerSpec]:
    spec = WorkerSpec(role=Role.DECODE, index=0, epoch=2, frontend_address="tcp://x:1",
                      engine_args={})
    runtime, dispatcher, load_times = _Runtime(alive={spec.identity}), _Dispatcher(), LoadTimes()
    load_times.started(spec.identity, 0.0)
    if registered:
        dispatcher.table.seen.add(spec.identity)  # and since removed (not in .workers)
    config = ServeConfig(mode="agg", decode=1, restart_workers=restart,
                         deadlines=DeadlineConfig(heartbeat_timeout_s=HEARTBEAT,
                                                  worker_start_timeout_s=START))
    supervisor = Supervisor([WorkerHandle(spec, 0)], runtime, dispatcher,  # type: ignore[arg-type]
                            config, load_times, retired=[])
    return supervisor, runtime, dispatcher, spec


def test_a_start_that_never_registers_is_killed_at_its_deadline_and_not_restarted() -> None:
    supervisor, runtime, dispatcher, spec = _supervised(registered=False)
    supervisor.tick(START - 1)
    assert runtime.stops == [] and dispatcher.link.revoked == []
    supervisor.tick(START + 1)
    assert runtime.stops[0] == ("decode-0", 0.0)  # killed at once, not asked to stop
    assert dispatcher.link.revoked == [spec.identity] and spec.identity not in runtime.alive
    assert spec.identity not in supervisor.load_times.pending  # never a load-time sample
    # Retired: the planner must not count it as a worker warming up for ever.
    assert supervisor.handles == [] and [h.spec for h in supervisor.retired] == [spec]
    for now in (START + 2, START + 100):
        supervisor.tick(now)
    assert runtime.starts == []  # it would hang the same way again


def test_without_restarts_an_exited_worker_is_retired() -> None:
    supervisor, runtime, dispatcher, spec = _supervised(registered=True, restart=False)
    supervisor.tick(1.0)
    assert supervisor.handles and not supervisor.retired  # removed but alive: fencing's turn
    runtime.alive.clear()  # it heard it was fenced and exited
    supervisor.tick(2.0)
    assert supervisor.handles == [] and [h.spec for h in supervisor.retired] == [spec]
    supervisor.tick(100.0)
    assert runtime.starts == [] and spec.identity in dispatcher.dead


def test_a_removed_worker_that_lives_on_is_killed_a_heartbeat_later_and_restarted() -> None:
    supervisor, runtime, dispatcher, spec = _supervised(registered=True)
    supervisor.tick(10.0)  # first seen removed, yet alive: it may still hear it is fenced
    supervisor.tick(10.0 + HEARTBEAT - 0.1)
    assert runtime.stops == []
    supervisor.tick(10.0 + HEARTBEAT)
    assert runtime.stops[0] == ("decode-0", 0.0) and spec.identity in dispatcher.dead
    assert supervisor.retired == []  # restarted below, not retired
    supervisor.tick(10.0 + HEARTBEAT + ServeConfig().ray.restart_backoff_s)
    assert runtime.starts == ["decode-0:3"]  # the next incarnation
    assert [h.spec.identity for h in supervisor.handles] == [b"decode-0:3"]
    assert dispatcher.metrics.worker_restarts.labels("decode-0")._value.get() == 1
