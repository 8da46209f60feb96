"""Operator actions on the cluster, behind the admin routes (api/admin.py): arm a fault
on a worker (protocol.FaultSpec; refused unless enabled), check every worker's KV pool,
purge a tenant's cache from every tier of every worker."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

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
        # (round, worker) -> its answer to come: a late answer never counts for another round
        self._answers: dict[tuple[int, bytes], asyncio.Future[P.Message]] = {}
        self._pool_round: asyncio.Future[dict[str, dict[str, object]]] | None = None
        self._round = 0

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
        answers = await self._ask_all(P.CheckPool, timeout_s)
        out: dict[str, dict[str, object]] = {}
        for worker_id, r in answers.items():
            if isinstance(r, P.PoolReport):
                out[worker_id] = {"ok": r.ok, "error": r.error, "used_blocks": r.num_used_blocks,
                                  "requests": r.num_requests}
            else:
                out[worker_id] = {"ok": False, "error": f"no answer within {timeout_s} s"}
        return out

    async def purge_tenant(self, tenant: str | None, timeout_s: float = 30.0
                           ) -> dict[str, object]:
        """Every live worker deletes the tenant's cached blocks from every tier (the bytes
        overwritten); what each removed, by tier, and the totals."""
        answers = await self._ask_all(lambda round_: P.PurgeTenant(round_, tenant), timeout_s)
        workers: dict[str, object] = {}
        totals: dict[str, dict[str, int]] = {}
        for worker_id, r in answers.items():
            if not isinstance(r, P.TenantPurged):
                workers[worker_id] = {"error": f"no answer within {timeout_s} s"}
                continue
            workers[worker_id] = {"removed": {c.tier: {"blocks": c.blocks, "bytes": c.bytes}
                                              for c in r.removed}, "error": r.error}
            for c in r.removed:
                total = totals.setdefault(c.tier, {"blocks": 0, "bytes": 0})
                total["blocks"] += c.blocks
                total["bytes"] += c.bytes
        return {"tenant": tenant, "removed": totals, "workers": workers}

    async def _ask_all(self, make: Callable[[int], P.Message], timeout_s: float
                       ) -> dict[str, P.Message | None]:
        """Sends `make(round)` to every healthy worker; each one's answer of that round (or
        None after `timeout_s`), by worker id. Late answers of a round are dropped."""
        loop = asyncio.get_running_loop()
        self._round += 1
        round_ = self._round
        asked = {w.identity: w.worker_id for w in self.table.workers.values() if w.healthy}
        futures = {identity: loop.create_future() for identity in asked}
        for identity, future in futures.items():
            self._answers[(round_, identity)] = future
            self.link.send(identity, make(round_))
        try:
            if futures:  # asyncio.wait refuses an empty set
                await asyncio.wait(list(futures.values()), timeout=timeout_s)
        finally:
            for identity in futures:
                self._answers.pop((round_, identity), None)
        return {asked[i]: f.result() if f.done() else None for i, f in futures.items()}

    def on_answer(self, identity: bytes, msg: P.PoolReport | P.TenantPurged) -> None:
        future = self._answers.get((msg.round, identity))
        if future is not None and not future.done():
            future.set_result(msg)
