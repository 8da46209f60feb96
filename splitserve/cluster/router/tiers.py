"""The tiers below each worker's pool, as the router sees them (DESIGN.md 5 and 6):
which blocks a worker's host and disk tiers hold (TierEventBatch), how fast each loads
(the worker's reports), and so how far a request's cached prefix extends on that worker
beyond its pool, under the same rule the worker applies (store/speed.py): a block below
the pool counts only while loading it is faster than recomputing it.

The pool's own index (indexer.py) says how many leading blocks worker w holds in its
pool (n0); `extend` continues from block n0 through w's lower tiers, fastest tier
first, and stops at the first block w holds nowhere or would rather recompute. Events of
a tier with a gap in their sequence make the router forget that tier of that worker
until a batch that starts with AllBlocksCleared (a resync): a forgotten block is only a
missed credit, a stale one only a recompute.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.kv_cache.block_hash import BlockHash
from splitserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from splitserve.store.block import TierName
from splitserve.store.speed import TierSpeeds, blocks_worth_loading

TIERS = (TierName.HOST, TierName.DISK)  # fastest first


@dataclass(slots=True)
class _WorkerTiers:
    held: dict[TierName, set[BlockHash]] = field(
        default_factory=lambda: {tier: set() for tier in TIERS})
    seq: dict[TierName, int] = field(default_factory=dict)
    lost: set[TierName] = field(default_factory=set)  # a gap: ignored until a resync
    speeds: TierSpeeds = field(default_factory=TierSpeeds)
    loads: dict[TierName, tuple[int, float]] = field(default_factory=dict)  # cumulative


class TierIndex:
    def __init__(self) -> None:
        self._workers: dict[str, _WorkerTiers] = {}

    def __bool__(self) -> bool:
        """Whether any worker reported a tier (routing skips tiers otherwise)."""
        return bool(self._workers)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker_id: str, tier: TierName) -> int:
        entry = self._workers.get(worker_id)
        return len(entry.held[tier]) if entry is not None else 0

    def apply(self, worker_id: str, tier: TierName, seq: int, events: Iterable[KVEvent]
              ) -> None:
        events = list(events)
        entry = self._workers.setdefault(worker_id, _WorkerTiers())
        held, last = entry.held[tier], entry.seq.get(tier)
        if last is not None and seq <= last:
            return  # a repeat
        entry.seq[tier] = seq
        resync = bool(events) and isinstance(events[0], AllBlocksCleared)
        if not resync and (tier in entry.lost or (last is not None and seq != last + 1)):
            held.clear()  # lost track: forget until a resync (see the module docstring)
            entry.lost.add(tier)
            return
        entry.lost.discard(tier)
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            else:
                held.clear()

    def observe_loads(self, worker_id: str, tier: TierName, blocks: int, seconds: float
                      ) -> None:
        """The worker's cumulative blocks loaded from `tier` and the seconds they took."""
        entry = self._workers.setdefault(worker_id, _WorkerTiers())
        before_blocks, before_s = entry.loads.get(tier, (0, 0.0))
        if blocks > before_blocks:
            entry.speeds.observe(tier, blocks - before_blocks, seconds - before_s)
        entry.loads[tier] = (blocks, seconds)

    def speeds(self, worker_id: str) -> TierSpeeds:
        return self._workers.setdefault(worker_id, _WorkerTiers()).speeds

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def extend(self, worker_id: str, block_hashes: Sequence[BlockHash], start: int,
               block_bytes: int, recompute_block_s: float | None) -> tuple[int, float]:
        """How many blocks after the first `start` the worker would load from its tiers
        rather than recompute, and the seconds loading them takes."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return 0, 0.0
        tiers: list[TierName] = []
        for block_hash in block_hashes[start:]:
            tier = next((t for t in TIERS if block_hash in entry.held[t]), None)
            if tier is None:
                break
            tiers.append(tier)
        n = blocks_worth_loading(tiers, entry.speeds, block_bytes, recompute_block_s)
        return n, sum(entry.speeds.block_s(t, block_bytes) for t in tiers[:n])
