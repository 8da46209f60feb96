"""KV cache events that feed the router's prefix index (DESIGN.md section 5).

The pool records them in order; the worker drains them with `BlockPool.take_events()`
and adds its per-worker sequence number before publishing.
"""
from __future__ import annotations

from dataclasses import dataclass

from .block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the prefix cache.

    `block_hashes` is a chain: each hash is the child of the one before it, and the
    first is the child of `parent_hash` (None: a child of the sequence's root).
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse, or the cache was reset)."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of this worker left the prefix cache; drop all its index entries."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
