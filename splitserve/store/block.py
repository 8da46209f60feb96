"""The KV store's data types: which tier, which block, what a put did, what a tier counts,
and the change feed the router reads (DESIGN.md 6).

A block is one engine block's KV for every layer (K and V), an opaque payload of a fixed
size per store, named by its 16-byte chained hash (DESIGN.md 4.1). Tiers index blocks by
(tenant, hash): a tenant only ever sees its own copy of a hash, so no answer of a tier
reveals whether another tenant holds it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from splitserve.kv_cache.block_hash import HASH_SIZE, BlockHash


class TierName(enum.Enum):
    """A tier below the engine pool (tier 0). Values are metric label values."""

    HOST = "host"
    DISK = "disk"


class PutOutcome(enum.Enum):
    STORED = "stored"
    ALREADY = "already"  # the tenant holds this hash already: its LRU position was refreshed
    REFUSED = "refused"  # see RefusalReason
    QUEUED = "queued"  # TieredStore only: handed to the disk writer, counted there when written


class RefusalReason(enum.Enum):
    QUOTA = "quota"  # over the tenant's quota, and evicting its own blocks cannot make room
    TOO_BIG = "too_big"  # the block is larger than the whole tier
    NOT_ADMITTED = "not_admitted"  # the disk admission policy wants a reused block
    BUSY = "busy"  # the disk writer's queue is full (or the store is closing)
    IO_ERROR = "io_error"  # the disk write failed (disk full, permissions): nothing kept


class DiskAdmission(enum.StrEnum):
    """Which blocks the disk tier takes (`--kv-disk-admission`)."""

    REUSED = "reused"  # only blocks hit at least once in a tier above (DESIGN.md 6)
    ALL = "all"


class AllTenants(enum.Enum):
    """The type of ALL_TENANTS: `hashes()` of every tenant, where None is the tenant ""."""

    ALL = "all"


ALL_TENANTS = AllTenants.ALL


def tenant_id(tenant: str | None) -> str:
    """The tenant's accounting name: no tenant (None) is the tenant ""."""
    return "" if tenant is None else tenant


@dataclass(frozen=True, slots=True)
class BlockKey:
    """A block as the store files it. `parent_hash` is the previous block of the chain
    (None: the first block); the router's index needs it to place the block."""

    block_hash: BlockHash
    parent_hash: BlockHash | None
    tenant: str | None

    def __post_init__(self) -> None:
        for name, value in (("block_hash", self.block_hash), ("parent_hash", self.parent_hash)):
            if value is not None and (not isinstance(value, bytes) or len(value) != HASH_SIZE):
                raise ValueError(f"BlockKey.{name} must be {HASH_SIZE} bytes (a block hash "
                                 f"from kv_cache.block_hash), got {value!r:.60}")

    @property
    def tenant_id(self) -> str:
        return tenant_id(self.tenant)


@dataclass(frozen=True, slots=True)
class PutResult:
    """What a put did. `evicted` lists the blocks it pushed out to make room, oldest first
    (already wiped from this tier when the put returns)."""

    outcome: PutOutcome
    reason: RefusalReason | None = None
    evicted: list[BlockKey] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PurgeReport:
    """What a purge removed (and securely wiped) from one tier."""

    blocks: int
    bytes: int


@dataclass(frozen=True, slots=True)
class TierEvent:
    """What entered (`stored`) and left (`removed`, hashes) one tier, in order; one of the
    two is empty. A `resync` event replaces everything the consumer knows of this tier:
    `stored` is then the tier's whole content (sent first, and after the backlog overflowed).
    A hash is reported removed only once no tenant's copy of it is left in the tier."""

    tier: TierName
    stored: tuple[BlockKey, ...] = ()
    removed: tuple[BlockHash, ...] = ()
    resync: bool = False


@dataclass(slots=True)
class TierStats:
    """One tier's gauges (capacity, used, blocks, per-tenant use) and counters (the rest,
    which only go up: they become Prometheus counters). Bytes count payload bytes; a disk
    file adds a header of about a hundred bytes that quotas and capacity do not count."""

    tier: TierName
    capacity_bytes: int
    block_bytes: int
    used_bytes: int = 0
    blocks: int = 0
    tenant_used_bytes: dict[str, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0  # corrupt reads included
    puts: dict[PutOutcome, int] = field(default_factory=dict)
    refusals: dict[RefusalReason, int] = field(default_factory=dict)
    evictions: int = 0  # blocks pushed out for capacity or quota
    removals: int = 0  # blocks deleted by remove() or a purge
    corrupt: int = 0  # disk: files that failed their header or authentication check
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0
    store_seconds: float = 0.0

    def count_put(self, outcome: PutOutcome, reason: RefusalReason | None = None) -> None:
        self.puts[outcome] = self.puts.get(outcome, 0) + 1
        if reason is not None:
            self.refusals[reason] = self.refusals.get(reason, 0) + 1

    def copy(self) -> TierStats:
        return replace(self, tenant_used_bytes=dict(self.tenant_used_bytes),
                       puts=dict(self.puts), refusals=dict(self.refusals))
