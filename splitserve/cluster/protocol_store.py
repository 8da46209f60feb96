"""The protocol's messages about the KV store below the workers' pools (store/): purging a
tenant, the tiers' events and usage, and peer fetch of a prompt prefix another worker
holds. Part of the one message union in cluster/protocol.py, which re-exports them.
"""
from __future__ import annotations

from dataclasses import dataclass

from splitserve.errors import ProtocolError
from splitserve.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored

STORE_TIERS = ("host", "disk")  # store.block.TierName's values


def _check_tier(tier: str) -> None:
    if tier not in STORE_TIERS:
        raise ProtocolError(f"tier {tier!r} is not one of {STORE_TIERS}")


@dataclass(slots=True)
class PurgeTenant:
    """Delete the tenant's cached blocks from every tier (wiped), answer TenantPurged."""
    round: int
    tenant: str | None


@dataclass(slots=True)
class TierCount:
    """One tier's share of an answer: blocks and payload bytes ("device" is the pool)."""
    tier: str
    blocks: int
    bytes: int


@dataclass(slots=True)
class TenantPurged:
    round: int  # the PurgeTenant's
    removed: list[TierCount]
    error: str | None  # a tier that could not finish in time (the rest was purged)


@dataclass(slots=True)
class TierEventBatch:
    """What entered and left one tier below a worker's pool (store/), for the router's
    tier index. A gap in `seq` (per worker and tier) makes the router forget that tier of
    the worker until a batch starting with AllBlocksCleared (a resync) comes."""
    seq: int
    tier: str  # "host" | "disk"
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    def __post_init__(self) -> None:
        _check_tier(self.tier)


@dataclass(slots=True)
class TierUsage:
    """A tier below a worker's pool (store/): current use and cumulative counts."""
    tier: str  # "host" | "disk"
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int  # blocks brought up into the pool (a hit that served a request)
    misses: int
    evictions: int
    corrupt: int  # disk files that failed their checks (recomputed instead)
    bytes_read: int
    bytes_written: int
    load_seconds: float
    store_seconds: float
    refusals: list[TierCount]  # by reason, in `tier` (quota, busy, not_admitted, ...)
    tenants: list[TierCount]  # bytes in use per tenant, in `tier` ("" = no tenant)

    def __post_init__(self) -> None:
        _check_tier(self.tier)


@dataclass(slots=True)
class ExportPrefix:
    """Peer fetch: send a prompt prefix this worker holds (pool, host or disk tier) to the
    worker that awaits it (Generate with kv_prefix_end). Nothing is computed: the blocks
    are held at once (engine.hold_prefix) and sent where the importer's plan (KVPlan)
    says; PrefillDone follows. Holding less than the whole prefix: RequestFailed."""
    request_id: str
    prompt_token_ids: list[int]  # the prefix
    namespace: str | None
    kv_timeout_s: float
    tenant: str | None = None


@dataclass(slots=True)
class CancelImport:
    """Stop awaiting a request's prefix (its holder failed or left): prefill it all here."""
    request_id: str
