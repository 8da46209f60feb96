"""The router's prefix index: which worker holds which cached block (DESIGN.md 5).

Block hashes are chained (DESIGN.md 4.1), so a hash names its whole prefix: the radix
tree over chains needs no child maps. Each node is keyed by its own hash and records
its parent's hash (None: a first block, or unknown after a snapshot) and the set of
workers holding it, as a bitmask over per-worker slots. A lookup walks the request's own
hash list and intersects masks; a worker drops out at its first miss, exactly as the
engine's own `cached_prefix` stops there.

    match([h0, h1, h2, h3])      node(h0).workers = {A, B, C}
                                 node(h1).workers = {A, B}
      -> {A: 3, B: 2, C: 1}      node(h2).workers = {A}  (h3 not indexed)

Each worker's batches of events carry a sequence number. The first batch may start
anywhere; a gap makes `apply` return False and the worker's events are ignored until
`apply_snapshot` replaces everything known about it. Its old entries stay meanwhile:
a stale hit only costs a recompute (DESIGN.md 5).

Tenant accounting: a node may have an owner tenant, learnt from `claim` (the router
claims each dispatched request's hashes) or inherited from its parent when stored (so a
decode worker's output blocks count for the prompt's tenant). `tenant_blocks` counts a
tenant's distinct indexed blocks; `evict_tenant` drops its least recently used ones.
Memory follows the indexed blocks, not the tenants ever seen: a tenant is forgotten with
its last indexed block, and pending claims are capped (MAX_PENDING_CLAIMS), so clients
rotating tenants or salts leave nothing behind.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.kv_cache.block_hash import BlockHash
from splitserve.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# Claimed hashes not yet stored anywhere; oldest claims are forgotten beyond this.
MAX_PENDING_CLAIMS = 1 << 16


@dataclass(slots=True)
class _Node:
    parent: BlockHash | None
    mask: int  # bit i set: the worker in slot i holds this block; never 0 while indexed
    tenant: str | None
    # Indexed nodes naming this one as parent. NOTE: a hint, not an invariant: a parent
    # dropped and stored again does not count the children that outlived it.
    num_children: int = 0


@dataclass(slots=True)
class _WorkerEntry:
    slot: int
    hashes: set[BlockHash] = field(default_factory=set)
    last_seq: int | None = None  # None: no batch applied yet, any seq may come first
    needs_resync: bool = False


class PrefixIndex:
    """Radix index over chained block hashes from every worker's KV events."""

    def __init__(self) -> None:
        self._nodes: dict[BlockHash, _Node] = {}
        self._workers: dict[str, _WorkerEntry] = {}
        self._slot_owner: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []
        self._num_entries = 0
        self._claims: OrderedDict[BlockHash, str] = OrderedDict()  # oldest first
        # tenant -> its nodes' hashes, least recently used first; never empty (a tenant
        # leaves with its last block)
        self._tenant_lru: dict[str, OrderedDict[BlockHash, None]] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct indexed hashes."""
        return len(self._nodes)

    @property
    def num_entries(self) -> int:
        """Indexed (hash, worker) pairs."""
        return self._num_entries

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def num_worker_blocks(self, worker_id: str) -> int:
        entry = self._workers.get(worker_id)
        return len(entry.hashes) if entry is not None else 0

    def needs_resync(self, worker_id: str) -> bool:
        """True after a sequence gap, until `apply_snapshot` for this worker."""
        entry = self._workers.get(worker_id)
        return entry is not None and entry.needs_resync

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """worker id -> number of leading `block_hashes` it holds (workers with 0 omitted)."""
        nodes = self._nodes
        alive = 0
        depth = 0
        matched: dict[str, int] = {}
        for block_hash in block_hashes:
            node = nodes.get(block_hash)
            if node is None:
                break
            if depth == 0:
                alive = node.mask
            else:
                kept = alive & node.mask
                if kept != alive:
                    self._assign(alive & ~kept, depth, matched)
                    alive = kept
                    if not alive:
                        break
            depth += 1
        self._assign(alive, depth, matched)
        return matched

    def apply(self, worker_id: str, seq: int, events: Iterable[KVEvent]) -> bool:
        """Apply one batch of a worker's events.

        Returns False when `seq` leaves a gap (or the worker already awaits a resync):
        the batch is ignored and the caller must fetch a snapshot. A repeated or old
        `seq` is ignored and returns True.
        """
        entry = self._entry(worker_id)
        if entry.needs_resync:
            return False
        if entry.last_seq is not None:
            if seq <= entry.last_seq:
                return True
            if seq != entry.last_seq + 1:
                entry.needs_resync = True
                return False
        entry.last_seq = seq
        for event in events:
            if isinstance(event, BlockStored):
                self._store(entry, event.block_hashes, event.parent_hash)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._unset(entry, block_hash)
            else:
                assert isinstance(event, AllBlocksCleared), f"unknown event {event!r}"
                self._clear(entry)
        return True

    def apply_snapshot(self, worker_id: str, seq: int, block_hashes: Iterable[BlockHash]) -> None:
        """Replace all that is known about a worker by the flat list of hashes it holds
        after its batch `seq`; parents are unknown, so new nodes get none."""
        entry = self._entry(worker_id)
        self._clear(entry)
        for block_hash in block_hashes:
            self._set(entry, block_hash, None)
        entry.last_seq = seq
        entry.needs_resync = False

    def remove_worker(self, worker_id: str) -> None:
        """Drop every entry of a worker that left; unknown ids are ignored."""
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return
        self._clear(entry)
        self._slot_owner[entry.slot] = None
        self._free_slots.append(entry.slot)

    def remove_blocks(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        """Forget that a worker holds these blocks (outside its event stream)."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            for block_hash in block_hashes:
                self._unset(entry, block_hash)

    # -- tenants -----------------------------------------------------------------------
    def claim(self, block_hashes: Sequence[BlockHash], tenant: str) -> None:
        """Attribute a request's chain to `tenant` (first owner wins) and mark its indexed
        prefix as just used. The first hash not indexed yet is remembered until some
        worker stores it; the blocks after it inherit the tenant from their parent."""
        indexed: list[tuple[BlockHash, _Node]] = []
        for block_hash in block_hashes:
            node = self._nodes.get(block_hash)
            if node is None:
                if block_hash not in self._claims and len(self._claims) >= MAX_PENDING_CLAIMS:
                    self._claims.popitem(last=False)
                self._claims.setdefault(block_hash, tenant)
                break
            indexed.append((block_hash, node))
        # NOTE: touched from the tail to the root, so a chain's tail is the older end and
        # `evict_tenant` drops chains tail-first, never cutting a prefix out from under them.
        for block_hash, node in reversed(indexed):
            if node.tenant is None:
                node.tenant = tenant
                self._tenant_lru.setdefault(tenant, OrderedDict())[block_hash] = None
            elif node.tenant == tenant:
                self._tenant_lru[tenant].move_to_end(block_hash)

    def tenants(self) -> list[str]:
        """Tenants that own indexed blocks."""
        return list(self._tenant_lru)

    @property
    def num_tenants(self) -> int:
        """Tenants that own indexed blocks (what the index remembers of tenants)."""
        return len(self._tenant_lru)

    @property
    def num_pending_claims(self) -> int:
        """Claimed hashes no worker has stored yet (at most MAX_PENDING_CLAIMS)."""
        return len(self._claims)

    def tenant_blocks(self, tenant: str) -> int:
        """Distinct indexed blocks owned by `tenant`."""
        return len(self._tenant_lru.get(tenant, ()))

    def evict_tenant(self, tenant: str, num_blocks: int) -> dict[str, list[BlockHash]]:
        """Remove up to `num_blocks` of the tenant's blocks from the index, least
        recently used leaves first (a chain loses its tail before its root), and return,
        per worker, the hashes it held among them (for the caller to evict there)."""
        lru = self._tenant_lru.get(tenant, OrderedDict())  # emptied (and dropped) below
        evicted: dict[str, list[BlockHash]] = {}
        num_left = min(num_blocks, len(lru))
        leaves_only = True
        while num_left > 0:
            num_before = num_left
            for block_hash in list(lru):
                node = self._nodes.get(block_hash)
                if node is None or (leaves_only and node.num_children > 0):
                    continue  # gone by now, or still a prefix of an indexed block
                for worker_id in self._workers_in(node.mask):
                    evicted.setdefault(worker_id, []).append(block_hash)
                    self._unset(self._workers[worker_id], block_hash)
                num_left -= 1
                if num_left == 0:
                    break
            # Parents freed by this pass are leaves in the next; stale child counts may
            # leave no leaf at all, then plain LRU order decides.
            leaves_only = num_left < num_before
        return evicted

    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        for worker_id, entry in self._workers.items():
            assert self._slot_owner[entry.slot] == worker_id, f"{worker_id} slot mismatch"
            bit = 1 << entry.slot
            for block_hash in entry.hashes:
                node = self._nodes.get(block_hash)
                assert node is not None and node.mask & bit, (
                    f"{worker_id} lists {block_hash.hex()} but its node lacks the worker")
        assert self._num_entries == sum(len(e.hashes) for e in self._workers.values()), (
            "num_entries != sum of per-worker hash sets")
        owned: dict[str, int] = {}
        for block_hash, node in self._nodes.items():
            assert node.mask != 0, f"node {block_hash.hex()} has no workers"
            for worker_id in self._workers_in(node.mask):
                assert block_hash in self._workers[worker_id].hashes, (
                    f"node {block_hash.hex()} names {worker_id}, which does not list it")
            if node.tenant is not None:
                assert block_hash in self._tenant_lru[node.tenant], "owned node not in LRU"
                owned[node.tenant] = owned.get(node.tenant, 0) + 1
        for tenant, lru in self._tenant_lru.items():
            assert lru, f"tenant {tenant} has an empty LRU (it should have been dropped)"
            assert len(lru) == owned.get(tenant, 0), f"tenant {tenant} LRU size mismatch"

    # -- internals ---------------------------------------------------------------------
    def _entry(self, worker_id: str) -> _WorkerEntry:
        entry = self._workers.get(worker_id)
        if entry is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_owner[slot] = worker_id
            else:
                slot = len(self._slot_owner)
                self._slot_owner.append(worker_id)
            entry = self._workers[worker_id] = _WorkerEntry(slot)
        return entry

    def _workers_in(self, mask: int) -> list[str]:
        found = []
        while mask:
            low = mask & -mask
            owner = self._slot_owner[low.bit_length() - 1]
            assert owner is not None, "mask names a free slot"
            found.append(owner)
            mask ^= low
        return found

    def _assign(self, mask: int, depth: int, matched: dict[str, int]) -> None:
        for worker_id in self._workers_in(mask):
            matched[worker_id] = depth

    def _store(self, entry: _WorkerEntry, block_hashes: Sequence[BlockHash],
               parent: BlockHash | None) -> None:
        for block_hash in block_hashes:
            self._set(entry, block_hash, parent)
            parent = block_hash
        if block_hashes:
            node = self._nodes[block_hashes[0]]
            if node.tenant is not None:
                # Same tail-to-root order as `claim`.
                self.claim(block_hashes, node.tenant)

    def _set(self, entry: _WorkerEntry, block_hash: BlockHash, parent: BlockHash | None) -> None:
        if block_hash in entry.hashes:
            return
        node = self._nodes.get(block_hash)
        if node is None:
            tenant = self._claims.pop(block_hash, None)
            parent_node = self._nodes.get(parent) if parent is not None else None
            if tenant is None and parent_node is not None:
                tenant = parent_node.tenant
            node = self._nodes[block_hash] = _Node(parent, 0, tenant)
            if parent_node is not None:
                parent_node.num_children += 1
            if tenant is not None:
                self._tenant_lru.setdefault(tenant, OrderedDict())[block_hash] = None
        node.mask |= 1 << entry.slot
        entry.hashes.add(block_hash)
        self._num_entries += 1

    def _unset(self, entry: _WorkerEntry, block_hash: BlockHash) -> None:
        if block_hash not in entry.hashes:
            return
        entry.hashes.discard(block_hash)
        self._num_entries -= 1
        node = self._nodes[block_hash]
        node.mask &= ~(1 << entry.slot)
        if node.mask == 0:
            # NOTE: children keep their own nodes; lookups through this hash now stop here,
            # which is right: no worker holds the prefix up to it any more.
            del self._nodes[block_hash]
            parent_node = self._nodes.get(node.parent) if node.parent is not None else None
            if parent_node is not None and parent_node.num_children > 0:
                parent_node.num_children -= 1
            if node.tenant is not None:
                lru = self._tenant_lru[node.tenant]
                del lru[block_hash]
                if not lru:
                    del self._tenant_lru[node.tenant]

    def _clear(self, entry: _WorkerEntry) -> None:
        for block_hash in list(entry.hashes):
            self._unset(entry, block_hash)
