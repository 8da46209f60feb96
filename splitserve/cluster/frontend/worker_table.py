"""The frontend's view of its workers: who registered, with what, and who is still alive.

Workers are keyed by their ZeroMQ routing id (`<role>-<index>:<epoch>`). A message from an
identity that never registered, or from an older epoch of a worker that was replaced, is
refused: a restarted worker cannot be confused with its previous incarnation.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from splitserve.cluster.protocol import Role, WorkerReady
from splitserve.errors import ProtocolError


@dataclass(slots=True)
class WorkerInfo:
    identity: bytes
    ready: WorkerReady
    last_seen: float  # monotonic time of the last message
    healthy: bool = True
    # Requests this worker holds state for, so a death fails exactly those.
    request_ids: set[str] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.ready.worker_id

    @property
    def role(self) -> Role:
        return self.ready.role


class WorkerTable:
    def __init__(self) -> None:
        self.workers: dict[bytes, WorkerInfo] = {}
        self.by_id: dict[str, WorkerInfo] = {}
        self.fingerprint: str | None = None
        self.seen: set[bytes] = set()  # every identity that ever registered

    def register(self, identity: bytes, ready: WorkerReady) -> WorkerInfo:
        """Adds a worker; all workers must share one model fingerprint (same model, dtype,
        block size and KV format), or their KV could not move between them."""
        name, _, epoch = identity.decode(errors="replace").partition(":")
        if name != ready.worker_id or not epoch.isdigit():
            raise ProtocolError(f"identity {identity!r} does not match worker "
                                f"{ready.worker_id!r}")
        if self.fingerprint is not None and ready.fingerprint != self.fingerprint:
            raise ProtocolError(f"worker {ready.worker_id} runs another model (fingerprint "
                                f"{ready.fingerprint[:12]} != {self.fingerprint[:12]}); "
                                "every worker must load the same model, dtype and block size")
        self.fingerprint = ready.fingerprint
        old = self.by_id.get(ready.worker_id)
        if old is not None:  # a new incarnation replaces the old one
            self.workers.pop(old.identity, None)
        info = WorkerInfo(identity, ready, time.monotonic())
        self.seen.add(identity)
        self.workers[identity] = info
        self.by_id[ready.worker_id] = info
        return info

    def get(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.get(identity)

    def remove(self, identity: bytes) -> WorkerInfo | None:
        info = self.workers.pop(identity, None)
        if info is not None and self.by_id.get(info.worker_id) is info:
            del self.by_id[info.worker_id]
        return info

    def healthy(self) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.healthy]

    def overdue(self, timeout_s: float, now: float) -> list[WorkerInfo]:
        """Healthy workers silent for longer than `timeout_s` (load reports are heartbeats)."""
        return [w for w in self.workers.values() if w.healthy and now - w.last_seen > timeout_s]
