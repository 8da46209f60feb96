"""Runtimes: where workers run. `local` (child processes) is the only one so far."""
from __future__ import annotations

from typing import Callable

from splitserve.cluster.runtime.base import Runtime, WorkerHandle
from splitserve.cluster.runtime.local import LocalRuntime, split_cores

__all__ = ["Runtime", "WorkerHandle", "LocalRuntime", "split_cores", "RUNTIMES", "get_runtime"]


RUNTIMES: dict[str, Callable[[], Runtime]] = {"local": LocalRuntime}


def get_runtime(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise KeyError(f"runtime {name!r} is not supported; use one of {sorted(RUNTIMES)}")
    return RUNTIMES[name]()
