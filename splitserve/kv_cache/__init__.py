"""KV block bookkeeping: chained block hashes, the block pool and per-request tables.

Memory-only: this package hands out block ids; the KV tensors live in the model runner.
"""
from __future__ import annotations

from .block_hash import BlockHash, hash_block, hash_full_blocks, root_hash
from .block_pool import BlockPool, KVBlock
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .manager import KVCacheManager

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVBlock",
    "KVCacheManager",
    "KVEvent",
    "hash_block",
    "hash_full_blocks",
    "root_hash",
]
