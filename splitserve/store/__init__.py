"""KV tiers below the engine pool (DESIGN.md 6): host memory and local disk per worker,
keyed by block hash and tenant, with LRU, quotas, admission by reuse and secure deletion.
Pure components: the worker wires a TieredStore under its engine (`build_store`)."""
from __future__ import annotations

from .block import (ALL_TENANTS, BlockKey, DiskAdmission, PurgeReport, PutOutcome, PutResult,
                    RefusalReason, TierEvent, TierName, TierStats)
from .config import StoreConfig
from .crypto import new_master_key
from .disk import DiskTier
from .host import HostTier
from .tiers import TieredStore, build_store

__all__ = [
    "ALL_TENANTS", "BlockKey", "DiskAdmission", "DiskTier", "HostTier", "PurgeReport",
    "PutOutcome", "PutResult", "RefusalReason", "StoreConfig", "TierEvent", "TierName",
    "TierStats", "TieredStore", "build_store", "new_master_key",
]
