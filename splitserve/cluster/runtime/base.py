"""Starting and stopping workers: one small interface, two runtimes (local.py, ray.py).

A runtime launches a worker from a `WorkerSpec` (cluster/worker/spec.py) and its
`WorkerSecret` (cluster/auth.py), and reports whether it is alive. Everything else
(registration, tokens, KV) goes over the frontend's socket, so the local runtime's child
process and the Ray runtime's actor run the same `Worker`. The secret must reach the
worker privately: never on a command line or in an environment (LocalRuntime writes it
to the child's stdin; RayRuntime passes it as an actor argument over Ray's links).
A runtime whose workers outlive the frontend also lets a new frontend find and adopt
them (`find_workers`, `adopt_worker`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.worker.spec import WorkerSpec


@dataclass
class WorkerHandle:
    spec: WorkerSpec
    pid: int | None = None  # where the runtime knows one


class Runtime(ABC):
    """Starts workers somewhere and tells whether they still run."""

    # Where the frontend's control socket binds: an address every worker can reach.
    control_host: str = "127.0.0.1"

    def worker_spec(self, spec: WorkerSpec) -> WorkerSpec:
        """The spec as this runtime runs it (a Ray worker: its CPUs as threads, no core
        pinning, outliving the frontend)."""
        return spec

    def reserve(self, specs: list[WorkerSpec], timeout_s: float) -> None:
        """Called once before the first start_worker with every worker the cluster will
        run (a Ray runtime makes its placement groups here)."""

    @abstractmethod
    def start_worker(self, spec: WorkerSpec, secret: WorkerSecret) -> WorkerHandle: ...

    @abstractmethod
    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        """Asks the worker to stop (it frees its KV and checks its pool), kills it after
        `timeout_s`; returns when it is gone."""

    @abstractmethod
    def is_alive(self, handle: WorkerHandle) -> bool: ...

    def shutdown(self, handles: list[WorkerHandle], timeout_s: float = 10.0) -> None:
        for handle in handles:
            self.stop_worker(handle, timeout_s)

    def rename(self, handle: WorkerHandle, spec: WorkerSpec) -> WorkerHandle:
        """The same running worker under a new spec (a role switch: new role, index and
        incarnation, same process)."""
        return WorkerHandle(spec, handle.pid)

    # -- workers that outlive the frontend (none on a runtime whose workers die with it) -----
    def find_workers(self) -> list[WorkerSpec]:
        """Live workers a previous frontend of this cluster left behind."""
        return []

    def adopt_worker(self, spec: WorkerSpec, frontend_address: str,
                     secret: WorkerSecret) -> WorkerHandle:
        """Hands a found worker this frontend's address and a fresh secret: it ends the
        old frontend's requests and registers again, with its weights and its cache."""
        raise NotImplementedError(f"{type(self).__name__} cannot adopt workers")

    def release_found(self, timeout_s: float = 10.0) -> None:
        """Stops the found workers that were not adopted (no longer asked for)."""
