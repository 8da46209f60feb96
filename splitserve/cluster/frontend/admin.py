"""Operator actions on the cluster, behind the admin routes (api/admin.py): arm a fault
on a worker (protocol.FaultSpec; refused unless enabled) and check every worker's KV pool."""
from __future__ import annotations

import asyncio

from splitserve.cluster import protocol as P
from splitserve.cluster.protocol import FaultSpec
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.worker_table import WorkerTable


class ClusterAdmin:
    def __init__(self, table: WorkerTable, link: WorkerLink, metrics: Metrics, *,
                 fault_injection: bool) -> None:
        self.table, self.link, self.metrics = table, link, metrics
        self.enabled = fault_injection
        self._pool_reports: dict[bytes, asyncio.Future[P.PoolReport]] = {}
        self._pool_round: asyncio.Future[dict[str, dict[str, object]]] | None = None
        self._round = 0  # of the latest round: answers to earlier ones are dropped

    def inject_fault(self, worker_id: str, spec: dict[str, object]) -> FaultSpec:
        """Arms a fault on a worker (cluster/worker/faults.py); refused unless enabled."""
        if not self.enabled:
            raise PermissionError("fault injection is disabled; start the server with "
                                  "--enable-fault-injection")
        fault = FaultSpec.from_dict(dict(spec))
        worker = self.table.by_id.get(worker_id)
        if worker is None:
            raise KeyError(f"no worker {worker_id!r}; workers: {sorted(self.table.by_id)}")
        self.link.send(worker.identity, P.InjectFault(fault))
        self.metrics.faults_injected.labels(fault.kind).inc()
        return fault

    async def check_pools(self, timeout_s: float = 5.0) -> dict[str, dict[str, object]]:
        """Every live worker checks its KV pool's invariants; what each answered.

        Calls while a round of checks is under way share that round: each worker is asked
        once and its answer goes to every caller (so concurrent calls neither take each
        other's answers nor multiply the checks). A caller that leaves does not end the
        round for the others."""
        if self._pool_round is None or self._pool_round.done():
            self._pool_round = asyncio.ensure_future(self._check_round(timeout_s))
        answers = await asyncio.shield(self._pool_round)
        return {worker_id: dict(answer) for worker_id, answer in answers.items()}

    async def _check_round(self, timeout_s: float) -> dict[str, dict[str, object]]:
        loop = asyncio.get_running_loop()
        self._round += 1
        asked = {w.identity: w.worker_id for w in self.table.workers.values() if w.healthy}
        futures = {identity: loop.create_future() for identity in asked}
        self._pool_reports.update(futures)
        for identity in asked:
            self.link.send(identity, P.CheckPool(self._round))
        if futures:  # asyncio.wait refuses an empty set
            await asyncio.wait(list(futures.values()), timeout=timeout_s)
        out: dict[str, dict[str, object]] = {}
        for identity, future in futures.items():
            self._pool_reports.pop(identity, None)
            if future.done():
                r = future.result()
                out[asked[identity]] = {"ok": r.ok, "error": r.error,
                                        "used_blocks": r.num_used_blocks,
                                        "requests": r.num_requests}
            else:
                out[asked[identity]] = {"ok": False, "error": f"no answer within {timeout_s} s"}
        return out

    def on_pool_report(self, identity: bytes, msg: P.PoolReport) -> None:
        future = self._pool_reports.get(identity)
        if msg.round == self._round and future is not None and not future.done():
            future.set_result(msg)
