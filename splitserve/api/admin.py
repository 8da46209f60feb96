"""Operator routes beside the OpenAI API:

    POST /admin/faults   arm a fault on a worker (cluster/worker/faults.py); 403 unless the server
                         runs with --enable-fault-injection
    GET  /admin/pools    every live worker checks its KV pool's invariants and says what
                         it holds (after traffic stops: no used blocks, no requests)

Like the rest of the server, they bind to 127.0.0.1 unless told otherwise.
"""
from __future__ import annotations

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict

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

    app.add_api_route("/admin/faults", inject_fault, methods=["POST"])
    app.add_api_route("/admin/pools", check_pools, methods=["GET"])
