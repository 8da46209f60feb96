"""What a runtime hands a worker to start it: plain JSON on the command line, nothing
secret (role, index, incarnation, where the frontend listens, engine arguments, cores).
The worker's control-plane key travels apart from it (cluster/auth.py: WorkerSecret)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from splitserve.cluster.protocol import Role


@dataclass(frozen=True)
class WorkerSpec:
    role: Role
    index: int
    epoch: int  # incarnation: a restarted worker gets a new one (fencing, DESIGN 7)
    frontend_address: str  # ZeroMQ address of the frontend's ROUTER socket
    engine_args: dict[str, Any] = field(default_factory=dict)  # EngineConfig.from_kwargs
    # Pin to these cores, with as many torch threads unless engine_args names a number
    # (--threads-per-worker, or a share of cores other workers use too).
    cpu_cores: tuple[int, ...] | None = None
    # A prefill worker's helper threads (cluster/worker/lending.py): one on each core a
    # decode worker lends it, each watching its lease (a file); a decode worker's leases
    # on the cores it lends (borrowed_cores empty).
    borrowed_cores: tuple[int, ...] = ()
    leases: tuple[str, ...] = ()
    # A lending decode worker's step interval while the borrower has prompts (its pacing:
    # lending.py); None: it steps whenever it has work.
    pace_s: float | None = None
    # Added to the process's niceness at start, before any thread (ServeConfig.worker_nice;
    # local workers: a Ray actor's process is Ray's).
    nice: int = 0
    kv_transport: str = "tcp"  # how this worker receives KV: "tcp" | "shm"
    # When a prefill's KV leaves layer by layer during its step rather than after it:
    # "auto" | "on" | "off" (ServeConfig.kv_stream_layers, KVSender.stream_layers).
    kv_stream_layers: str = "auto"
    # The TCP KV listener binds this host with port 0 and publishes the address it got
    # (WorkerReady.kv_address): the node's own address on Ray, loopback locally.
    kv_host: str = "127.0.0.1"
    # When the frontend is gone, wait to be adopted by a new one (Worker.adopt) instead
    # of exiting: Ray workers outlive the frontend; local ones die with it.
    outlive_frontend: bool = False
    report_interval_s: float = 0.1  # load reports, which double as heartbeats
    # An idle worker's report repeats itself: it is sent only this often (the heartbeat;
    # a fraction of the frontend's heartbeat deadline).
    heartbeat_interval_s: float = 1.0
    fault_injection: bool = False  # accept InjectFault (tests, chaos, soak; worker/faults.py)
    # A send the frontend has not taken in this long (it is gone or stuck, and ZeroMQ's
    # queue is full) ends the worker instead of blocking its engine thread for good.
    send_timeout_s: float = 30.0
    # Tiers below the engine pool: store.config.StoreConfig's keys, its disk directory
    # this worker's own (the launcher names it); empty: no store.
    store: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))  # ValueError for an unknown one

    @property
    def num_threads(self) -> int | None:
        """Torch (and OpenMP) threads: the engine's setting, else one per pinned core."""
        threads = self.engine_args.get("num_threads")
        return int(threads) if threads else len(self.cpu_cores) if self.cpu_cores else None

    @property
    def worker_id(self) -> str:
        return f"{self.role.value}-{self.index}"

    @property
    def identity(self) -> bytes:
        """The worker's ZeroMQ routing id: who it is and which incarnation."""
        return f"{self.worker_id}:{self.epoch}".encode()

    def same_work(self, other: WorkerSpec) -> bool:
        """The same worker but for its incarnation and frontend (may be adopted for it)."""
        return replace(self, epoch=other.epoch, frontend_address=other.frontend_address,
                       kv_host=other.kv_host) == other

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> WorkerSpec:
        data = json.loads(text)
        for key in ("cpu_cores", "borrowed_cores", "leases"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return WorkerSpec(**data)
