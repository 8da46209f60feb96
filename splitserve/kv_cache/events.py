"""KV cache events that feed the router's prefix index (DESIGN.md section 5), and the
bounded log a block pool records them in while a consumer is attached.

The worker attaches (`BlockPool.enable_events`), drains them with `take_events()` every
step and adds its per-worker sequence number before publishing. Nobody else records: an
offline engine's pool keeps no events at all.
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


class EventLog:
    """Events not yet taken by the consumer, oldest first, holding at most `max_hashes`
    block hashes. Beyond that the backlog is dropped and `overflowed` set: replaying the
    rest would no longer rebuild the consumer's view, so it gets the whole cached set
    instead (see `BlockPool.take_events`), which is never bigger than the pool.

    Consecutive events merge when that loses nothing: removals always, stores when the new
    block continues the open event's chain. Fewer, bigger messages for the router; the open
    event's hash list grows in place (amortized O(1) per block).
    """

    def __init__(self, max_hashes: int) -> None:
        if max_hashes <= 0:
            raise ValueError(f"max_hashes={max_hashes} must be positive")
        self.max_hashes = max_hashes
        self.overflowed = False
        self._pending: list[_PendingEvent] = []
        self._num_hashes = 0

    def stored(self, block_hash: BlockHash, parent_hash: BlockHash | None) -> None:
        if not self._count():
            return
        last = self._pending[-1] if self._pending else None
        if (last is not None and last.is_stored and parent_hash is not None
                and last.block_hashes[-1] == parent_hash):
            last.block_hashes.append(block_hash)
        else:
            self._pending.append(_PendingEvent(True, [block_hash], parent_hash))

    def removed(self, block_hash: BlockHash) -> None:
        if not self._count():
            return
        last = self._pending[-1] if self._pending else None
        if last is not None and not last.is_stored:
            last.block_hashes.append(block_hash)
        else:
            self._pending.append(_PendingEvent(False, [block_hash], None))

    def take(self) -> list[KVEvent]:
        """The backlog, oldest first; the log starts over empty (and not overflowed)."""
        events = [pending.freeze() for pending in self._pending]
        self._pending, self._num_hashes, self.overflowed = [], 0, False
        return events

    def _count(self) -> bool:
        """Counts one more hash; False (after dropping the backlog) once it overflows."""
        if self.overflowed:
            return False
        self._num_hashes += 1
        if self._num_hashes > self.max_hashes:
            self._pending, self._num_hashes, self.overflowed = [], 0, True
            return False
        return True


@dataclass(slots=True)
class _PendingEvent:
    """A BlockStored (is_stored) or BlockRemoved still open for merging."""

    is_stored: bool
    block_hashes: list[BlockHash]
    parent_hash: BlockHash | None

    def freeze(self) -> KVEvent:
        if self.is_stored:
            return BlockStored(tuple(self.block_hashes), self.parent_hash)
        return BlockRemoved(tuple(self.block_hashes))
