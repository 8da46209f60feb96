"""The local runtime: workers as child OS processes of the frontend, pinned to cores."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from splitserve.cluster.runtime.base import Runtime, WorkerHandle
from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.worker.spec import WorkerSpec

logger = logging.getLogger(__name__)


class LocalRuntime(Runtime):
    """Workers as child OS processes of this one (`python -m splitserve.cluster.worker`).
    They die with their parent (PR_SET_PDEATHSIG and a parent check), so a killed frontend
    leaves no orphans."""

    def __init__(self) -> None:
        self._procs: dict[bytes, subprocess.Popen[bytes]] = {}

    def start_worker(self, spec: WorkerSpec, secret: WorkerSecret) -> WorkerHandle:
        proc = subprocess.Popen([sys.executable, "-m", "splitserve.cluster.worker",
                                 spec.to_json()], env=_worker_env(spec),
                                stdin=subprocess.PIPE)
        assert proc.stdin is not None
        try:  # the secret goes through a pipe only this child reads (not argv, not env)
            proc.stdin.write(secret.to_bytes())
            proc.stdin.close()
        except BrokenPipeError:  # it died at once; the launcher sees it exit
            logger.warning("%s exited before reading its secret", spec.worker_id)
        self._procs[spec.identity] = proc
        logger.info("started %s (pid %d, cores %s)", spec.worker_id, proc.pid, spec.cpu_cores)
        return WorkerHandle(spec, proc.pid)

    def rename(self, handle: WorkerHandle, spec: WorkerSpec) -> WorkerHandle:
        self._procs[spec.identity] = self._procs.pop(handle.spec.identity)
        return WorkerHandle(spec, handle.pid)

    def stop_worker(self, handle: WorkerHandle, timeout_s: float = 10.0) -> None:
        proc = self._procs.get(handle.spec.identity)
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        self._reap(handle, timeout_s)

    def _reap(self, handle: WorkerHandle, timeout_s: float) -> None:
        """Waits for a signalled worker to exit, without signalling it again: a second
        SIGTERM that lands while its interpreter shuts down (Python has put the default
        handler back by then) would kill it mid-exit."""
        proc = self._procs.pop(handle.spec.identity, None)
        if proc is None:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            if timeout_s:
                logger.warning("%s did not stop within %.0f s; killing it",
                               handle.spec.worker_id, timeout_s)
            proc.kill()
            proc.wait(5)
            return
        if proc.returncode:  # a crash on the way out (a native thread, a destructor)
            logger.warning("%s exited with code %d when stopped", handle.spec.worker_id,
                           proc.returncode)

    def is_alive(self, handle: WorkerHandle) -> bool:
        proc = self._procs.get(handle.spec.identity)
        return proc is not None and proc.poll() is None

    def shutdown(self, handles: list[WorkerHandle], timeout_s: float = 10.0) -> None:
        for handle in handles:  # signal all first, then wait: they stop in parallel
            proc = self._procs.get(handle.spec.identity)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for handle in handles:
            self._reap(handle, timeout_s)


def _worker_env(spec: WorkerSpec) -> dict[str, str]:
    env = dict(os.environ)
    if spec.num_threads:
        # OpenMP reads these before torch starts; the worker also pins and sets threads.
        env["OMP_NUM_THREADS"] = str(spec.num_threads)
        env["MKL_NUM_THREADS"] = str(spec.num_threads)
    return env


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
