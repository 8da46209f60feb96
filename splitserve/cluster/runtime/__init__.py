"""Runtimes: where workers run. `local`: child processes of the frontend; `ray`: Ray
actors across machines (imported only when asked for: Ray is an optional extra)."""
from __future__ import annotations

from splitserve.cluster.runtime.base import Runtime, WorkerHandle
from splitserve.cluster.runtime.local import LocalRuntime, split_cores
from splitserve.config import ServeConfig

__all__ = ["Runtime", "WorkerHandle", "LocalRuntime", "split_cores", "get_runtime"]


def get_runtime(config: ServeConfig) -> Runtime:
    if config.runtime == "local":
        return LocalRuntime()
    if config.runtime == "ray":
        try:
            from splitserve.cluster.runtime.ray import RayRuntime
        except ImportError as exc:
            raise RuntimeError("--runtime ray needs Ray: pip install 'splitserve[ray]'") from exc
        return RayRuntime(config.ray)
    raise ValueError(f"runtime {config.runtime!r} is not supported; use local or ray")
