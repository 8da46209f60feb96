"""Starting and stopping workers: one small interface, a local-process implementation.

A runtime only launches a worker from a `WorkerSpec` (plain JSON: role, index, epoch,
where the frontend listens, engine arguments, CPU cores) and reports whether it is alive.
Everything else (registration, tokens, KV) goes over the frontend's socket, so a Ray
runtime can implement the same interface by starting the same worker as an actor.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class WorkerSpec:
    role: str  # "prefill" | "decode" | "both" (aggregated)
    index: int
    epoch: int  # incarnation: a restarted worker gets a new one (fencing, DESIGN 7)
    frontend_address: str  # ZeroMQ address of the frontend's ROUTER socket
    engine_args: dict[str, Any] = field(default_factory=dict)  # EngineConfig.from_kwargs
    cpu_cores: tuple[int, ...] | None = None  # pin to these cores (and as many threads)
    kv_transport: str = "tcp"  # how this worker receives KV: "tcp" | "shm"
    report_interval_s: float = 0.1  # load reports, which double as heartbeats
    fault_injection: bool = False  # accept InjectFault (tests, chaos, soak; cluster/faults.py)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {ROLES}")

    @property
    def worker_id(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def identity(self) -> bytes:
        """The worker's ZeroMQ routing id: who it is and which incarnation."""
        return f"{self.worker_id}:{self.epoch}".encode()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> WorkerSpec:
        data = json.loads(text)
        if data.get("cpu_cores") is not None:
            data["cpu_cores"] = tuple(data["cpu_cores"])
        return WorkerSpec(**data)


@dataclass
class WorkerHandle:
    spec: WorkerSpec
    pid: int | None = None  # where the runtime knows one


class Runtime(ABC):
    """Starts workers somewhere and tells whether they still run."""

    @abstractmethod
    def start_worker(self, spec: WorkerSpec) -> WorkerHandle: ...

    @abstractmethod
    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        """Asks the worker to stop (it frees its KV and checks its pool), kills it after
        `timeout_s`; returns when it is gone."""

    @abstractmethod
    def is_alive(self, handle: WorkerHandle) -> bool: ...

    def shutdown(self, handles: list[WorkerHandle], timeout_s: float = 10.0) -> None:
        for handle in handles:
            self.stop_worker(handle, timeout_s)


class LocalRuntime(Runtime):
    """Workers as child OS processes of this one (`python -m splitserve.cluster.worker`).
    They die with their parent (PR_SET_PDEATHSIG and a parent check), so a killed frontend
    leaves no orphans."""

    def __init__(self) -> None:
        self._procs: dict[bytes, subprocess.Popen[bytes]] = {}

    def start_worker(self, spec: WorkerSpec) -> WorkerHandle:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve.cluster.worker",
                                 spec.to_json()], env=_worker_env(spec))
        self._procs[spec.identity] = proc
        logger.info("started %s (pid %d, cores %s)", spec.worker_id, proc.pid, spec.cpu_cores)
        return WorkerHandle(spec, proc.pid)

    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        proc = self._procs.pop(handle.spec.identity, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", handle.spec.worker_id,
                           timeout_s)
            proc.kill()
            proc.wait(5)

    def is_alive(self, handle: WorkerHandle) -> bool:
        proc = self._procs.get(handle.spec.identity)
        return proc is not None and proc.poll() is None

    def shutdown(self, handles: list[WorkerHandle], timeout_s: float = 10.0) -> None:
        for handle in handles:  # signal all first, then wait: they stop in parallel
            proc = self._procs.get(handle.spec.identity)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for handle in handles:
            self.stop_worker(handle, timeout_s)


def _worker_env(spec: WorkerSpec) -> dict[str, str]:
    env = dict(os.environ)
    if spec.cpu_cores:
        # OpenMP reads these before torch starts; the worker also pins and sets threads.
        env["OMP_NUM_THREADS"] = str(len(spec.cpu_cores))
        env["MKL_NUM_THREADS"] = str(len(spec.cpu_cores))
    return env


RUNTIMES: dict[str, Callable[[], Runtime]] = {"local": LocalRuntime}


def get_runtime(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise KeyError(f"runtime {name!r} is not supported; use one of {sorted(RUNTIMES)}")
    return RUNTIMES[name]()


def split_cores(cores: list[int], counts: list[int]) -> list[list[tuple[int, ...]]]:
    """Cores for each worker of each pool: `counts[i]` workers in pool i. Cores are split
    in proportion to the number of workers, each worker on its own contiguous slice;
    with fewer cores than workers, workers share cores one each, round-robin."""
    num_workers = sum(counts)
    flat: list[tuple[int, ...]] = []
    if len(cores) < num_workers:
        flat = [(cores[i % len(cores)],) for i in range(num_workers)]
    else:
        base, extra = divmod(len(cores), num_workers)
        pos = 0
        for i in range(num_workers):
            n = base + (1 if i < extra else 0)
            flat.append(tuple(cores[pos:pos + n]))
            pos += n
    out, pos = [], 0
    for count in counts:
        out.append(flat[pos:pos + count])
        pos += count
    return out
