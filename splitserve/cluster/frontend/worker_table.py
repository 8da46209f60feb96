"""The frontend's view of its workers: who registered, with what, and who is still alive.

Workers are keyed by their ZeroMQ routing id (`<role>-<index>:<epoch>`), which the
worker's CURVE key vouches for (cluster/auth.py). A message from an identity that never
registered, or from an older epoch of a worker that was replaced, is refused: a restarted
worker cannot be confused with its previous incarnation. A registration is checked whole
before anything changes (`check`).
"""
from __future__ import annotations

import math
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
    draining: bool = False  # out of routing, its requests moving elsewhere (Dispatcher.drain)
    joined: float = 0.0  # monotonic time it registered (a planner treats it as warming a while)
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

    def check(self, identity: bytes, ready: WorkerReady) -> None:
        """Raises ProtocolError unless `ready` may register as `identity`; changes nothing
        (validate before mutating: a refused registration removes no one).

        The identity (`<role>-<index>:<epoch>`, vouched for by the worker's key) must name
        the worker and role the message claims; a registered identity cannot register
        again, a removed one never comes back, and a new incarnation must be newer than
        the one it replaces. All workers share one model fingerprint (same model, dtype,
        block size, KV format and kernels' arithmetic), or their KV could not move between
        them."""
        epoch = _epoch(identity, ready.worker_id)
        role, _, index = ready.worker_id.rpartition("-")
        if role != ready.role.value or not index.isdigit():
            raise ProtocolError(f"worker id {ready.worker_id!r} does not name role "
                                f"{ready.role.value!r}")
        if identity in self.workers:
            raise ProtocolError(f"{ready.worker_id} is already registered as {identity!r}")
        if identity in self.seen:
            raise ProtocolError(f"{identity!r} was removed; a removed incarnation does not "
                                "come back")
        old = self.by_id.get(ready.worker_id)
        if old is not None and _epoch(old.identity, old.worker_id) >= epoch:
            raise ProtocolError(f"{identity!r} is not newer than the registered "
                                f"{old.identity!r}")
        if self.fingerprint is not None and ready.fingerprint != self.fingerprint:
            raise ProtocolError(f"worker {ready.worker_id} runs another model (fingerprint "
                                f"{ready.fingerprint[:12]} != {self.fingerprint[:12]}); "
                                "every worker must load the same model, dtype and block "
                                "size, on kernels of the same arithmetic (exact kernels on AMX "
                                "have bits of their own: SPLITSERVE_CPU_ISA=avx512_bf16 on the "
                                "AMX machines gives them the other x86 machines' bits)")
        counts = {"pid": ready.pid, "block_size": ready.block_size,
                  "num_blocks": ready.num_blocks, "max_model_len": ready.max_model_len,
                  "max_num_seqs": ready.max_num_seqs,
                  "max_num_partial_prefills": ready.max_num_partial_prefills,
                  "kv_bytes_per_token": ready.kv_bytes_per_token}
        bad = [name for name, value in counts.items() if not 0 < value < 1 << 40]
        if bad or not 0 < len(ready.fingerprint) <= 128:
            raise ProtocolError(f"WorkerReady of {ready.worker_id}: bad {bad or 'fingerprint'}")
        if (ready.kv_address is not None) != ready.role.can_decode or (
                ready.kv_address is not None and not 0 < len(ready.kv_address) <= 256):
            raise ProtocolError(f"WorkerReady of {ready.worker_id}: a {ready.role.value} "
                                "worker must give a KV address iff it decodes")
        if ready.pace_s is not None and not (ready.role.can_decode and 0 < ready.pace_s <= 60):
            raise ProtocolError(f"WorkerReady of {ready.worker_id}: pace_s {ready.pace_s} is "
                                "not a decoding worker's (0, 60] seconds")

    def register(self, identity: bytes, ready: WorkerReady) -> WorkerInfo:
        """Adds a worker that passed `check`; a new incarnation replaces the old one."""
        self.check(identity, ready)
        self.fingerprint = ready.fingerprint
        old = self.by_id.get(ready.worker_id)
        if old is not None:
            self.workers.pop(old.identity, None)
        now = time.monotonic()
        info = WorkerInfo(identity, ready, now, joined=now)
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

    def next_due(self, timeout_s: float) -> float:
        """When the first healthy worker runs out of `timeout_s` of silence (inf: none)."""
        return min((w.last_seen + timeout_s for w in self.workers.values() if w.healthy),
                   default=math.inf)


def _epoch(identity: bytes, worker_id: str) -> int:
    """The incarnation in `<worker id>:<epoch>`; ProtocolError if it names another worker."""
    name, _, epoch = identity.decode(errors="replace").partition(":")
    if name != worker_id or not epoch.isdigit() or len(epoch) > 9:
        raise ProtocolError(f"identity {identity!r} does not match worker {worker_id!r}")
    return int(epoch)
