"""What the HTTP frontend needs from whatever serves requests behind it.

`splitserve.cluster.dispatcher.Dispatcher` is the real one (router + worker processes);
unit tests of the HTTP layer use a fake that implements the same methods.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    served_model_names: list[str]  # the first is the one /v1/models lists first
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int  # token ids a client sends must be below it
    created: int  # unix time the server started


class Backend(Protocol):
    model_info: ModelInfo

    def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        """Streams the request's deltas; the last has finished=True. The first may have no
        tokens (`StreamDelta.placed`: the request is on its workers). Raises (possibly
        before the first delta) InvalidRequestError (bad prompt, e.g. too long),
        AdmissionRejected (overloaded: 429/503 + Retry-After), RequestTimeout, WorkerFailed.
        Closing the iterator early (client gone) aborts the request on every worker."""
        ...

    def is_ready(self) -> bool:
        """True when at least one worker of each needed role is up and healthy."""
        ...

    def health(self) -> dict[str, object]:
        """JSON-able detail for operators (/admin/health): "workers", a list of dicts with
        at least "role" and "healthy" (and whatever identifies them), and counts such as
        "in_flight" and "queued". /health serves only counts of it (admin.health_summary)."""
        ...

    def metrics_text(self) -> bytes:
        """Prometheus exposition text of every splitserve_* metric."""
        ...

    def inject_fault(self, worker_id: str, spec: dict[str, object]) -> dict[str, object]:
        """Arms a fault on a worker; the armed spec. PermissionError when fault injection
        is off, KeyError for an unknown worker, InvalidRequestError for a bad spec."""
        ...

    async def check_pools(self) -> dict[str, dict[str, object]]:
        """Per live worker: its pool's invariant check and what it holds."""
        ...

    async def purge_tenant(self, tenant: str) -> dict[str, object]:
        """Deletes the tenant's cached KV from every tier of every worker (its bytes
        overwritten); what was removed, by tier and by worker."""
        ...

    def tenant_cache(self, tenant: str) -> dict[str, object]:
        """The tenant's cached KV bytes in the tiers below each worker's pool."""
        ...

    async def add_worker(self, role: str) -> str:
        """Starts one more worker of `role` (prefill | decode | both); its id. ValueError
        for a role the cluster has no pool of."""
        ...

    async def drain_worker(self, worker_id: str, timeout_s: float) -> dict[str, object]:
        """Moves a worker's decoding requests to other workers with their KV, then stops
        it; how many moved. KeyError for an unknown worker."""
        ...

    async def switch_role(self, worker_id: str, role: str, timeout_s: float) -> dict[str, object]:
        """Drains a worker, then it serves in the other pool under a new id, same process.
        KeyError for an unknown worker, ValueError for a role it cannot take."""
        ...
