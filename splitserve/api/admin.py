"""Operator routes beside the OpenAI API, all behind the admin key (api/auth.py: 401
without it, 403 on a server started without one):

    GET  /admin/health   the detailed view /health summarizes: every worker's id, role,
                         health, incarnation, pid and requests
    GET  /admin/pools    every live worker checks its KV pool's invariants and says what
                         it holds (after traffic stops: no used blocks, no requests);
                         concurrent calls share one round of checks
    POST /admin/faults   arm a fault on a worker (cluster/worker/faults.py); 403 unless the
                         server also runs with --enable-fault-injection
    POST /admin/workers  {"role": "decode"}: one more worker in that pool
    POST /admin/drain    {"worker": "decode-1", "timeout_s": 60}: its decoding requests move
                         to other decode workers with their KV (live migration), then it
                         stops for good; answers how many moved
    POST /admin/switch   {"worker": "prefill-0", "role": "decode"}: drained, then the same
                         process serves in the other pool under a new id
    GET    /admin/tenants/{tenant}/cache  the tenant's KV bytes in each tier of each worker
    DELETE /admin/tenants/{tenant}/cache  deletes its cached KV from every tier of every
                         worker (bytes overwritten: secure deletion); what was removed

Like the rest of the server, they bind to 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from fastapi import FastAPI, HTTPException, Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.api.auth import MAX_TENANT_CHARS
from splitserve.api.backend import Backend


class FaultRequest(BaseModel):
    """A FaultSpec (cluster/protocol.py) and the worker to arm it on, e.g. `decode-0`."""
    model_config = ConfigDict(extra="forbid")
    worker: str
    kind: str
    point: str = ""
    after: int = 0
    count: int = 1
    probability: float = 1.0
    seed: int = 0
    seconds: float = 0.0


class AddWorkerRequest(BaseModel):
    """Grow a pool by one worker."""
    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode", "both"]


class DrainRequest(BaseModel):
    """Move a worker's decoding requests away with their KV, then stop it."""
    model_config = ConfigDict(extra="forbid")
    worker: str = Field(max_length=64)
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class SwitchRoleRequest(BaseModel):
    """Drain a worker, then it serves in the other pool (same process, weights kept)."""
    model_config = ConfigDict(extra="forbid")
    worker: str = Field(max_length=64)
    role: Literal["prefill", "decode"]
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


def health_summary(detail: Mapping[str, object]) -> dict[str, object]:
    """What /health tells anyone: counts of workers (by role, healthy or not) and of
    requests, never a worker's identity, incarnation or pid (those are /admin/health's)."""
    workers = detail.get("workers", [])
    assert isinstance(workers, list), "Backend.health() lists its workers"
    total = Counter(str(w.get("role")) for w in workers)
    healthy = Counter(str(w.get("role")) for w in workers if w.get("healthy"))
    summary: dict[str, object] = {
        "workers": {"total": sum(total.values()), "healthy": sum(healthy.values()),
                    "by_role": {role: {"total": n, "healthy": healthy[role]}
                                for role, n in sorted(total.items())}}}
    for key in ("in_flight", "queued"):
        if key in detail:
            summary[key] = detail[key]
    return summary


def add_admin_routes(app: FastAPI, backend: Backend) -> None:
    async def inject_fault(body: FaultRequest) -> dict[str, object]:
        spec = body.model_dump(exclude={"worker"})
        try:
            armed = backend.inject_fault(body.worker, spec)
        except PermissionError as exc:
            raise HTTPException(403, str(exc)) from None
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        return {"worker": body.worker, "armed": armed}

    async def check_pools() -> dict[str, object]:
        return {"workers": await backend.check_pools()}

    async def health() -> dict[str, object]:
        return backend.health()

    async def add_worker(body: AddWorkerRequest) -> dict[str, object]:
        try:
            return {"worker": await backend.add_worker(body.role)}
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    async def drain_worker(body: DrainRequest) -> dict[str, object]:
        try:
            return await backend.drain_worker(body.worker, body.timeout_s)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None

    async def switch_role(body: SwitchRoleRequest) -> dict[str, object]:
        try:
            return await backend.switch_role(body.worker, body.role, body.timeout_s)
        except KeyError as exc:
            raise HTTPException(404, str(exc.args[0])) from None
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    async def purge_tenant(tenant: str = Path(max_length=MAX_TENANT_CHARS)) -> dict[str, object]:
        return await backend.purge_tenant(tenant)

    async def tenant_cache(tenant: str = Path(max_length=MAX_TENANT_CHARS)) -> dict[str, object]:
        return backend.tenant_cache(tenant)

    app.add_api_route("/admin/tenants/{tenant}/cache", purge_tenant, methods=["DELETE"])
    app.add_api_route("/admin/tenants/{tenant}/cache", tenant_cache, methods=["GET"])
    app.add_api_route("/admin/health", health, methods=["GET"])
    app.add_api_route("/admin/switch", switch_role, methods=["POST"])
    app.add_api_route("/admin/workers", add_worker, methods=["POST"])
    app.add_api_route("/admin/drain", drain_worker, methods=["POST"])
    app.add_api_route("/admin/faults", inject_fault, methods=["POST"])
    app.add_api_route("/admin/pools", check_pools, methods=["GET"])
