"""Keeps a cluster's workers running while it serves (DESIGN 7), as systemd or
Kubernetes would keep a service's processes: every WATCH_PERIOD_S it looks at each worker
the cluster started and acts on what it sees (`verdict`).

    the worker                                          verdict          action
    alive; registered, or starting within its deadline  RUNNING          none
    exited (process or actor, or its node)              EXITED           restart
    removed by the frontend (silent past its heartbeat  HUNG             kill, restart
      deadline) and alive a heartbeat deadline later
    alive, not registered --worker-start-timeout-s      STUCK_STARTING   kill, not
      after it was started                                               restarted

An exited worker is dead at once (no need to wait for heartbeats). With
`restart_workers`, a new incarnation (epoch + 1) takes its place after a backoff
(`restart_backoff_s`, doubling to 30 s while it keeps dying within a minute of its start);
every restart is counted (splitserve_worker_restarts_total). A worker that exits before it
ever registered is not restarted: it would fail the same way again. A worker not
restarted (that, or --no-restart-workers) is retired: its handle leaves the cluster's list
(into `retired`), so the planner sees the pool short, not a worker forever warming, and
a worker added later does not share cores with a dead one. A removed worker whose
process lives on is told to exit when it next speaks (fencing, frontend/workers.py); one
that never speaks again is hung, and without the kill it would keep its cores while the
pool stays a worker short for good. Likewise a start that never registers: the cluster's
own first start waits for its workers under the same deadline (Cluster.start)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from enum import Enum
from typing import TYPE_CHECKING

from splitserve.cluster.planner.load_time import LoadTimes
from splitserve.cluster.runtime import Runtime, WorkerHandle
from splitserve.config import ServeConfig

if TYPE_CHECKING:
    from splitserve.cluster.frontend.dispatcher import Dispatcher

logger = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0  # a restarted worker alive this long resets its backoff


class Verdict(str, Enum):
    RUNNING = "running"
    EXITED = "exited"
    HUNG = "hung"
    STUCK_STARTING = "stuck starting"


def verdict(*, alive: bool, registered_once: bool, removed_since: float | None,
            started_at: float | None, now: float, heartbeat_timeout_s: float,
            start_timeout_s: float) -> Verdict:
    """What the supervisor makes of one worker at `now`. `removed_since`: when it was
    first seen removed by the frontend while alive (None: not removed); `started_at`: when
    this cluster started it (None: adopted or renamed, not started here)."""
    if not alive:
        return Verdict.EXITED
    if removed_since is not None:
        return Verdict.HUNG if now - removed_since >= heartbeat_timeout_s else Verdict.RUNNING
    if not registered_once and started_at is not None and now - started_at > start_timeout_s:
        return Verdict.STUCK_STARTING
    return Verdict.RUNNING


def restart_delay(base_s: float, failures: int) -> float:
    """The wait before restarting a worker that died `failures` times in a row before."""
    return min(MAX_RESTART_BACKOFF_S, base_s * 2 ** min(failures, 16))


class Supervisor:
    """Watches `handles`, the cluster's own list, which its pool changes edit in place (a
    drained worker leaves it before it is stopped, a role switch renames its handle
    first); `load_times` says when each worker not yet registered was started."""

    def __init__(self, handles: list[WorkerHandle], runtime: Runtime, dispatcher: Dispatcher,
                 config: ServeConfig, load_times: LoadTimes,
                 retired: list[WorkerHandle]) -> None:
        self.handles, self.runtime, self.dispatcher = handles, runtime, dispatcher
        self.config, self.load_times, self.retired = config, load_times, retired
        self._failures: dict[str, int] = {}  # worker id -> restarts in a row
        self._started: dict[str, float] = {}  # worker id -> when its restart started
        self._restart_at: dict[str, float] = {}  # worker id -> when its restart is due
        self._removed_at: dict[bytes, float] = {}  # identity -> first seen removed, alive

    async def run(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        for handle in list(self.handles):
            wid = handle.spec.worker_id
            if wid in self._restart_at:
                if now >= self._restart_at[wid]:
                    del self._restart_at[wid]
                    self._restart(wid)
                continue
            self._check(handle, now)

    def _check(self, handle: WorkerHandle, now: float) -> None:
        spec, table, deadlines = handle.spec, self.dispatcher.table, self.config.deadlines
        alive = self.runtime.is_alive(handle)
        registered_once = spec.identity in table.seen
        removed = alive and registered_once and table.get(spec.identity) is None
        found = verdict(
            alive=alive, registered_once=registered_once,
            removed_since=self._removed_at.setdefault(spec.identity, now) if removed else None,
            started_at=self.load_times.pending.get(spec.identity), now=now,
            heartbeat_timeout_s=deadlines.heartbeat_timeout_s,
            start_timeout_s=deadlines.worker_start_timeout_s)
        if found is Verdict.RUNNING:
            if not removed and now - self._started.get(spec.worker_id, 0.0) > STABLE_AFTER_S:
                self._failures.pop(spec.worker_id, None)
            return
        if found is not Verdict.EXITED:
            logger.error("%s is %s; killing it", spec.worker_id, found.value)
            self.runtime.stop_worker(handle, timeout_s=0.0)
        self._removed_at.pop(spec.identity, None)
        if not registered_once:
            self.load_times.forget(spec.identity)  # a start that will never register
        self.dispatcher.mark_dead(spec.identity, "exited")
        self.dispatcher.link.revoke(spec.identity)  # registered or not: it is gone
        self.runtime.stop_worker(handle)  # reaps the exited process or actor
        if not self.config.restart_workers or not registered_once:
            self.handles.remove(handle)
            self.retired.append(handle)
            logger.error("%s exited and is not restarted (%s)", spec.worker_id,
                         "--no-restart-workers" if registered_once
                         else "it never registered")
            return
        n = self._failures.get(spec.worker_id, 0)
        self._failures[spec.worker_id] = n + 1
        delay = restart_delay(self.config.ray.restart_backoff_s, n)
        self._restart_at[spec.worker_id] = now + delay
        logger.warning("%s exited; restarting it in %.1f s", spec.worker_id, delay)

    def _restart(self, worker_id: str) -> None:
        i = next((i for i, h in enumerate(self.handles) if h.spec.worker_id == worker_id),
                 None)
        if i is None:  # drained meanwhile
            return
        spec = self.handles[i].spec
        new = replace(spec, epoch=spec.epoch + 1)
        self.load_times.started(new.identity, time.monotonic())
        self.handles[i] = self.runtime.start_worker(new, self.dispatcher.link.enroll(
            new.identity))
        self._started[worker_id] = time.monotonic()
        self.dispatcher.metrics.worker_restarts.labels(worker_id).inc()
        logger.warning("restarted %s as epoch %d", worker_id, new.epoch)
