"""The router's knobs (one frozen dataclass), the disaggregation policy, and the KV
layout the router learns from workers. The cost formulas the weights scale are in
scoring.py's docstring."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from splitserve.cluster.router.cost_model import CostModelConfig


class DisaggPolicy(IntEnum):
    """AUTO: conditional disaggregation; ALWAYS: prefill on the prefill pool (no
    placement while it is saturated); NEVER: the decode worker prefills."""

    AUTO = 0
    ALWAYS = 1
    NEVER = 2

    @staticmethod
    def from_name(name: str) -> DisaggPolicy:
        """"auto" | "always" | "never" (any case); ValueError lists them otherwise."""
        try:
            return DisaggPolicy[name.upper()]
        except KeyError:
            raise ValueError(f"disagg policy {name!r} is not one of "
                             f"{[p.name.lower() for p in DisaggPolicy]}") from None


@dataclass(frozen=True)
class KVLayout:
    """What the router learns from a worker at registration (`WorkerReady`), not a knob:
    the model's KV block size and KV bytes per token on the wire. The defaults are the
    default model's: 30 layers * K,V * 3 heads * 64 * bf16 = 23040 bytes."""

    block_size: int = 16
    kv_bytes_per_token: int = 23040

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError(f"block_size={self.block_size} and kv_bytes_per_token="
                             f"{self.kv_bytes_per_token} must be positive")


@dataclass(frozen=True)
class RouterConfig:
    """Every routing knob, with its default."""

    transfer_bandwidth_bytes_s: float = 2e9
    transfer_latency_s: float = 0.002  # per transfer: connect, header, commit round trips
    # Scale the cost terms: prefix credit, load (queue + decode step + stall), memory.
    locality_weight: float = 1.0
    load_weight: float = 1.0
    memory_weight: float = 1.0
    # Memory penalty scale: at KV usage x the penalty is memory_pressure_s * x / (1 - x).
    memory_pressure_s: float = 0.01
    # TPOT budget of running decodes; None: no limit on local prefills.
    tpot_slo_s: float | None = None
    # Output tokens a TPOT is averaged over: a stall of s seconds adds s / this to the
    # TPOT of each sequence it holds up.
    tpot_window_tokens: int = 64
    # A DisaggPolicy, or its name ("auto" | "always" | "never"), stored as DisaggPolicy.
    disagg: DisaggPolicy | str = DisaggPolicy.AUTO
    # Retry-After bounds for rejected requests, seconds.
    min_retry_after_s: float = 1.0
    max_retry_after_s: float = 60.0
    # Window over which the service rate (requests finished per second) is measured.
    service_rate_window_s: float = 30.0
    # Distinct cached blocks a tenant may keep in the cluster; None: no cap.
    tenant_max_cached_blocks: int | None = None
    # Peer fetch (--kv-peer-fetch): a local decision may import a longer prefix another
    # worker holds (pool or tiers) when that is predicted faster than recomputing it, and
    # at least this many blocks longer than the decode worker's own hit.
    peer_fetch: bool = False  # the cluster turns it on unless --no-kv-peer-fetch
    peer_min_blocks: int = 2
    cost: CostModelConfig = field(default_factory=CostModelConfig)

    def __post_init__(self) -> None:
        if self.tpot_window_tokens <= 0:
            raise ValueError(f"tpot_window_tokens={self.tpot_window_tokens} must be positive")
        if self.transfer_bandwidth_bytes_s <= 0:
            raise ValueError(f"transfer_bandwidth_bytes_s={self.transfer_bandwidth_bytes_s} "
                             f"must be positive")
        if min(self.locality_weight, self.load_weight, self.memory_weight,
               self.memory_pressure_s, self.transfer_latency_s) < 0:
            raise ValueError("router weights, memory_pressure_s and transfer_latency_s must "
                             "be non-negative")
        if self.tenant_max_cached_blocks is not None and self.tenant_max_cached_blocks < 0:
            raise ValueError(f"tenant_max_cached_blocks={self.tenant_max_cached_blocks} "
                             f"must be >= 0 or None")
        if self.peer_min_blocks < 1:
            raise ValueError(f"peer_min_blocks={self.peer_min_blocks} must be >= 1 (a peer "
                             f"fetch must bring at least one block the worker lacks)")
        if isinstance(self.disagg, str):
            # NOTE: frozen; normalizing once here lets `policy` be a plain read.
            object.__setattr__(self, "disagg", DisaggPolicy.from_name(self.disagg))

    @property
    def policy(self) -> DisaggPolicy:
        """`disagg` as a DisaggPolicy."""
        assert isinstance(self.disagg, DisaggPolicy)
        return self.disagg
