"""Starting and stopping workers: one small interface.

A runtime only launches a worker from a `WorkerSpec` (cluster/worker/spec.py) and its
`WorkerSecret` (cluster/auth.py), and reports whether it is alive. Everything else
(registration, tokens, KV) goes over the frontend's socket, so a Ray runtime can
implement the same interface by starting the same worker as an actor. The secret must
reach the worker privately: never on a command line or in an environment (LocalRuntime
writes it to the child's stdin).
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
