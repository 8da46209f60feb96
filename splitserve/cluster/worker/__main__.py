"""The worker process's entry point: `python -m splitserve.cluster.worker '<spec JSON>'`,
with its control-plane secret (cluster/auth.py) on stdin, never on the command line or in
the environment, where other local users could read it (/proc/<pid>/cmdline, environ).
Reads the secret first, pins the process to its cores, dies with its parent, runs the
Worker until told to stop."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from dataclasses import replace

from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.cluster.worker.worker import Worker


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent exits (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _renice(increment: int) -> None:
    """Every thread of this process `increment` nicer. Linux keeps a niceness per thread and
    a new thread inherits its creator's: the threads to come follow the main thread's, and
    those a library started at import (OpenBLAS's, under numpy) are set here."""
    nice = os.nice(increment)
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # ended meanwhile
                pass


def _read_secret() -> WorkerSecret:
    """The secret the runtime wrote to stdin and closed (a few hundred bytes)."""
    data = sys.stdin.buffer.read(4096)
    sys.stdin.close()
    return WorkerSecret.from_bytes(data)


def main(argv: list[str]) -> int:
    try:
        secret = _read_secret()
    except ValueError as exc:
        print(f"splitserve worker: {exc}", file=sys.stderr)
        return 2
    spec = WorkerSpec.from_json(argv[0])
    if spec.nice:
        _renice(spec.nice)  # before the worker's own threads, which inherit it
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {spec.worker_id} %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    import setproctitle
    setproctitle.setproctitle(f"splitserve-{spec.worker_id}")
    if spec.cpu_cores:
        os.sched_setaffinity(0, spec.cpu_cores)
        spec = replace(spec, engine_args={**spec.engine_args, "num_threads": spec.num_threads})
    worker = Worker(spec, secret)
    signal.signal(signal.SIGTERM, lambda *_: setattr(worker, "stopping", True))
    signal.signal(signal.SIGINT, lambda *_: setattr(worker, "stopping", True))
    worker.run()
    # Stopped: a later SIGTERM (the runtime's, the dead parent's) must not kill the exit
    # (Python puts back the default action of a handled signal while it shuts down).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
