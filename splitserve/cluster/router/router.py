"""The KV-aware router (DESIGN.md 5): places each request on a decode worker, and
decides whether a prefill worker computes its prompt first (conditional
disaggregation). Pure logic: no sockets, threads or I/O (the clock is injectable and
read only for the service rate and the TPOT horizon); the caller serializes calls.

    router = Router(RouterConfig(...))
    router.set_kv_layout(KVLayout(block_size, kv_bytes_per_token))   # from WorkerReady
    router.add_worker("p0", Role.PREFILL, load); router.add_worker("d0", Role.DECODE, load)
    router.apply_events(worker_id, seq, events)   # False: fetch a snapshot, then
    router.apply_snapshot(worker_id, seq, hashes)
    router.update_load(worker_id, load); router.observe_prefill(worker_id, tokens, s)
    decision = router.route(req)                  # None: all over budget -> admission queue
    router.on_dispatched(decision, req) ... router.on_finished(req.request_id)
    router.take_evictions()                       # tenant cap: hashes to evict per worker
    router.retry_after_s(num_queued)              # for a 429 when the queue is full

The costs (seconds: local prefill, remote prefill + transfer, peer fetch, load, memory)
are scoring.py's, whose docstring has the formulas; it evaluates them for all workers at
once. A worker is over budget when running + waiting >= max_num_seqs or its free KV
blocks cannot hold the prompt's uncached blocks. Policy AUTO takes the cheaper of the best local
and best remote option, except that a local prefill that would lift D's running
sequences over `tpot_slo_s` (max(step, pace) + (recent + full(u)) / tpot_window_tokens:
every local prefill of the horizon stalls the same sequences, and those arriving
meanwhile, so an idle worker is no exception; a decode worker that paces its steps while
a prefill worker borrows its core gives its sequences a token per pace) is not allowed; with
every prefill worker over budget it prefills locally. ALWAYS is remote or None, NEVER is
local. Without prefill workers (all BOTH) it picks the cheapest worker (AGGREGATED).
A request's own policy (`RouteRequest.disagg`, from the HTTP body) replaces the
configured one for that request only, within the same limits: ALWAYS with no prefill
worker up is AGGREGATED, and ALWAYS with every prefill worker over budget is None.

Tenant cap: the index counts each tenant's distinct cached blocks (claimed when its
requests are dispatched). Prefix credit is kept for a tenant over its cap (denying it
would only recompute, and store, more of its blocks); instead `take_evictions()` drops
the tenant's least recently used blocks from the index and returns them per worker for
the caller to evict there.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.kv_cache.block_hash import BlockHash
from splitserve.kv_cache.events import KVEvent
from splitserve.store.block import TierName

from splitserve.cluster.router.admission import ServiceRate, retry_after_s
from splitserve.cluster.router.cost_model import DecodeStepModel, PrefillCostModel
from splitserve.cluster.router.indexer import PrefixIndex
from splitserve.cluster.router.peer import best_peer, with_peer
from splitserve.cluster.router.tiers import TIERS, TierIndex
from splitserve.cluster.router.placement import RouteDecision, RouteReason, RouteRequest
from splitserve.cluster.router.config import DisaggPolicy, KVLayout, RouterConfig
from splitserve.cluster.router.scoring import WorkerColumns, WorkerTerms, argmin_where, score
from splitserve.cluster.router.load import InFlight, Role, WorkerLoad, WorkerState

__all__ = ["Router", "RouterConfig", "RouterStats", "DisaggPolicy", "KVLayout", "Role",
           "WorkerLoad", "RouteRequest", "RouteDecision", "RouteReason"]

_IS_PREFILL = WorkerTerms._fields.index("is_prefill")


@dataclass(slots=True)
class RouterStats:
    """Counters (decisions by reason are the dispatcher's `splitserve_router_decisions`)."""

    num_routed: int = 0
    num_unplaced: int = 0  # route() returned None
    num_indexed_blocks: int = 0
    num_index_entries: int = 0
    num_tier_blocks: int = 0  # prefix blocks credited below the chosen worker's pool
    num_peer_fetches: int = 0  # decisions that import a prefix from another worker


class Router:
    """Places requests; see the module docstring for the cost model and policies."""

    def __init__(self, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or RouterConfig()
        self.kv_layout = KVLayout()  # the default model's until a worker reports its own
        self._clock = clock
        self._finished = ServiceRate(self.config.service_rate_window_s)
        self.index = PrefixIndex()
        self.tiers = TierIndex()  # host and disk tiers below the workers' pools
        self._tier_credit: dict[str, int] = {}  # the route being decided: blocks below
        self._workers: dict[str, WorkerState] = {}
        self._pooled_prefill = PrefillCostModel(self.config.cost)
        self._pooled_decode = DecodeStepModel(self.config.cost)
        self._in_flight: dict[str, tuple[str, ...]] = {}  # request id -> its workers
        # NOTE: a worker's column is rebuilt as soon as its load or cost model changes (a
        # few us per report), so route() never pays for reports that arrived before it.
        self._columns = WorkerColumns()
        self._stats = RouterStats()
        slo = self.config.tpot_slo_s
        self._horizon_s = slo * self.config.tpot_window_tokens if slo is not None else 0.0

    # -- membership, load, events, timings -------------------------------------------------
    def set_kv_layout(self, kv_layout: KVLayout) -> None:
        """The model's KV block size and bytes per token, as a registering worker reports
        them (every worker serves the same model): block counts and transfer times use
        them."""
        self.kv_layout = kv_layout

    def add_worker(self, worker_id: str, role: Role, load: WorkerLoad) -> None:
        """Register a worker (again: its role and load are replaced, its index kept)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            self._workers[worker_id] = WorkerState.create(
                role, load, self.config.cost, self._pooled_prefill, self._pooled_decode)
        else:
            worker.role = role
            worker.report(load)
        # Columns are in registration order, so ties go to the first registered worker.
        self._refresh(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every index entry it had; unknown ids are ignored."""
        self._workers.pop(worker_id, None)
        self._columns.remove(worker_id)
        self.index.remove_worker(worker_id)
        self.tiers.remove_worker(worker_id)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def worker_state(self, worker_id: str) -> WorkerState | None:
        """A worker's load and cost models, read-only (the planner's view)."""
        return self._workers.get(worker_id)

    def update_load(self, worker_id: str, load: WorkerLoad,
                    received: Collection[str] | None = None) -> None:
        """A load report, which counts the requests in `received` (the ones that reached the
        worker since its previous report; None: every request dispatched so far): it
        replaces their share of the in-flight tally (see load.py)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.report(load, received)
            self._refresh(worker_id)

    def apply_events(self, worker_id: str, seq: int, events: Sequence[KVEvent]) -> bool:
        """Feed a batch of KV events; False: the caller must fetch a snapshot from the
        worker. Events of unregistered workers (e.g. late ones of a removed worker)
        are dropped and return True."""
        if worker_id not in self._workers:
            return True
        return self.index.apply(worker_id, seq, events)

    def apply_tier_events(self, worker_id: str, tier: TierName, seq: int,
                          events: Sequence[KVEvent]) -> None:
        """A worker's host or disk tier changed (tiers.py)."""
        if worker_id in self._workers:
            self.tiers.apply(worker_id, tier, seq, events)

    def tier_blocks(self) -> dict[str, dict[str, int]]:
        """Blocks each worker's host and disk tiers hold, as far as the router knows."""
        return {w: {t.value: self.tiers.num_blocks(w, t) for t in TIERS}
                for w in self.tiers.worker_ids()}

    def observe_tier_loads(self, worker_id: str, tier: TierName, blocks: int,
                           seconds: float) -> None:
        """A worker's cumulative blocks loaded from a tier and their seconds."""
        if worker_id in self._workers:
            self.tiers.observe_loads(worker_id, tier, blocks, seconds)

    def apply_snapshot(self, worker_id: str, seq: int, block_hashes: Sequence[BlockHash]) -> None:
        """Replace what the index knows of a worker by its full list of cached hashes."""
        if worker_id in self._workers:
            self.index.apply_snapshot(worker_id, seq, block_hashes)

    def invalidate(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """The worker turned out not to hold these blocks (a stale index entry): forget
        them until its events or a snapshot say otherwise."""
        if worker_id in self._workers:
            self.index.remove_blocks(worker_id, block_hashes)
            self._refresh(worker_id)

    def observe_prefill(self, worker_id: str, num_tokens: int, seconds: float) -> None:
        """A measured prefill of `num_tokens` uncached tokens on a worker."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            if worker.prefill_model.observe(num_tokens, seconds):
                self._refresh(worker_id)
            # A borrowing worker's steps ran on more cores than its own: not another's.
            if (not worker.load.borrows_cores
                    and self._pooled_prefill.observe(num_tokens, seconds)):
                # Unfitted workers predict with the pooled model.
                for other_id, other in self._workers.items():
                    if not other.prefill_model.is_fitted:
                        self._refresh(other_id)

    def observe_decode_step(self, worker_id: str, num_seqs: int, seconds: float) -> None:
        """A measured decode step over `num_seqs` sequences on a worker."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            if worker.decode_model.observe(num_seqs, seconds):
                self._refresh(worker_id)
            if (not worker.load.borrows_cores
                    and self._pooled_decode.observe(num_seqs, seconds)):
                for other_id, other in self._workers.items():
                    if not other.decode_model.is_fitted:
                        self._refresh(other_id)

    # -- routing ---------------------------------------------------------------------------
    def route(self, req: RouteRequest) -> RouteDecision | None:
        """Pick the decode worker and, if any, the prefill worker; None when no placement
        is within budget (the caller queues the request)."""
        self._tier_credit.clear()
        decision = self._route(req)
        if decision is None:
            self._stats.num_unplaced += 1
        else:
            self._stats.num_routed += 1
            placed = decision.prefill_worker or decision.decode_worker
            self._stats.num_tier_blocks += self._tier_credit.get(placed, 0)
            self._stats.num_peer_fetches += decision.peer is not None
        return decision

    def _route(self, req: RouteRequest) -> RouteDecision | None:
        config = self.config
        policy = req.disagg if req.disagg is not None else config.policy
        if req.num_prompt_tokens <= 0:
            raise ValueError(f"request {req.request_id!r} has {req.num_prompt_tokens} prompt "
                             f"tokens; the router places non-empty prompts only")
        if self._horizon_s:  # local prefills older than the horizon stop counting
            now = self._clock()
            for worker_id, worker in self._workers.items():
                if worker.expire_local_prefills(now - self._horizon_s):
                    self._refresh(worker_id)
        columns = self._columns
        hit_blocks = np.zeros(len(columns))
        for worker_id, num_blocks in self.index.match(req.block_hashes).items():
            hit_blocks[columns.column_of(worker_id)] = num_blocks
        load_s = self._tier_hits(req, hit_blocks) if self.tiers else None
        terms = columns.view()
        s = score(terms, hit_blocks, req.num_prompt_tokens, config, self.kv_layout, load_s)
        ids = columns.worker_ids

        def local_at(d: int, reason: RouteReason) -> RouteDecision:
            """Every local decision, importing a peer's longer prefix where that pays."""
            decision = RouteDecision.local(s, d, ids, reason)
            if not config.peer_fetch:
                return decision
            option = best_peer(s, hit_blocks, load_s, d, req.num_prompt_tokens,
                               self._workers[ids[d]].prefill_model, config, self.kv_layout)
            return decision if option is None else with_peer(decision, option, ids)

        local = argmin_where(s.local_cost, s.can_decode)
        if local is None:
            return None
        if not terms[_IS_PREFILL].any():
            return local_at(local, RouteReason.AGGREGATED)
        if policy == DisaggPolicy.NEVER:
            return local_at(local, RouteReason.FORCED_LOCAL)
        prefill = argmin_where(s.remote_prefill_cost, s.can_prefill)
        if prefill is None:
            if policy == DisaggPolicy.ALWAYS:
                return None
            return local_at(local, RouteReason.PREFILL_POOL_SATURATED)
        decode = argmin_where(s.remote_decode_cost, s.can_decode)
        assert decode is not None  # local is not None
        if policy == DisaggPolicy.ALWAYS:
            return RouteDecision.remote(s, prefill, decode, ids, RouteReason.FORCED_REMOTE)
        remote_cost = s.remote_prefill_cost[prefill] + s.remote_decode_cost[decode]
        best = argmin_where(s.local_cost, s.can_decode & s.within_tpot)
        if best is not None and s.local_cost[best] <= remote_cost:
            hit_won = (s.num_cached_tokens[best] > 0
                       and s.local_cost[best] + s.local_saving_s[best] > remote_cost)
            return local_at(best, RouteReason.LOCAL_PREFIX_HIT if hit_won
                            else RouteReason.LOCAL_FASTER)
        reason = (RouteReason.TPOT_BUDGET if s.local_cost[local] <= remote_cost
                  else RouteReason.REMOTE_FASTER)
        return RouteDecision.remote(s, prefill, decode, ids, reason)

    def _tier_hits(self, req: RouteRequest, hit_blocks: np.ndarray) -> np.ndarray:
        """Extends each worker's pool hit (`hit_blocks`, in place) through its host and
        disk tiers where loading beats recomputing; the seconds those loads take."""
        load_s = np.zeros(len(hit_blocks))
        bs = self.kv_layout.block_size
        block_bytes = self.kv_layout.kv_bytes_per_token * bs
        limit = (req.num_prompt_tokens - 1) // bs
        for col, worker_id in enumerate(self._columns.worker_ids):
            start = int(hit_blocks[col])
            if start >= limit:
                continue
            model = self._workers[worker_id].prefill_model
            recompute = model.predict(req.num_prompt_tokens) / req.num_prompt_tokens * bs
            more, seconds = self.tiers.extend(worker_id, req.block_hashes[:limit], start,
                                              block_bytes, recompute)
            hit_blocks[col] += more
            load_s[col] = seconds
            self._tier_credit[worker_id] = more
        return load_s

    def _refresh(self, worker_id: str) -> None:
        self._columns.set(worker_id,
                          self._workers[worker_id].terms(self._clock(), self._horizon_s))

    # -- in-flight accounting, tenants, stats ----------------------------------------------
    def on_dispatched(self, decision: RouteDecision, req: RouteRequest) -> None:
        """The caller sent `req` as decided: count its load until the workers' next load
        reports, and attribute its blocks to its tenant."""
        bs = self.kv_layout.block_size
        num_blocks = -(-req.num_prompt_tokens // bs)
        shares: dict[str, InFlight] = {}
        if decision.prefill_worker is not None:
            uncached = req.num_prompt_tokens - decision.num_cached_tokens
            shares[decision.prefill_worker] = InFlight(
                num_waiting=1, num_waiting_tokens=uncached,
                kv_blocks=num_blocks - decision.num_cached_tokens // bs)
            shares[decision.decode_worker] = InFlight(num_running=1, kv_blocks=num_blocks)
        else:
            uncached = req.num_prompt_tokens - decision.num_cached_tokens
            peer = decision.peer
            # A fetched prefix lands in new blocks of D's; a local hit shares cached ones.
            shared_blocks = 0 if peer is not None else decision.num_cached_tokens // bs
            shares[decision.decode_worker] = InFlight(
                num_waiting=1, num_waiting_tokens=uncached, kv_blocks=num_blocks - shared_blocks)
            if peer is not None:  # the holder holds the prefix (up from its tiers, maybe)
                assert peer.worker != decision.decode_worker
                shares[peer.worker] = InFlight(kv_blocks=peer.num_tokens // bs)
            worker = self._workers.get(decision.decode_worker)
            if worker is not None and self._horizon_s:
                worker.local_prefills.append((self._clock(),
                                              worker.prefill_model.predict(uncached)))
        for worker_id, share in shares.items():
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.dispatch(req.request_id, share)
                self._refresh(worker_id)
        self._in_flight[req.request_id] = tuple(shares)
        if req.tenant is not None:
            self.index.claim(req.block_hashes, req.tenant)

    def on_worker_done(self, worker_id: str, request_id: str) -> None:
        """`worker_id` sent the request's last output: it no longer counts there, even
        before the worker's next load report (load.py)."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.done(request_id)
            self._refresh(worker_id)

    def on_finished(self, request_id: str) -> None:
        """The request finished, failed or was aborted: drop its in-flight share."""
        self._finished.record(self._clock())
        for worker_id in self._in_flight.pop(request_id, ()):
            worker = self._workers.get(worker_id)
            if worker is not None:
                worker.finish(request_id)
                self._refresh(worker_id)

    def tenant_blocks(self, tenant: str) -> int:
        """Distinct blocks of `tenant` cached anywhere (as far as the index knows)."""
        return self.index.tenant_blocks(tenant)

    def take_evictions(self) -> dict[str, list[BlockHash]]:
        """Per worker, the hashes to evict so that every tenant is back within
        `tenant_max_cached_blocks` (least recently used first; the index forgets them
        now). Empty without a cap."""
        cap = self.config.tenant_max_cached_blocks
        evictions: dict[str, list[BlockHash]] = {}
        if cap is None:
            return evictions
        for tenant in self.index.tenants():
            excess = self.index.tenant_blocks(tenant) - cap
            if excess > 0:
                for worker_id, hashes in self.index.evict_tenant(tenant, excess).items():
                    evictions.setdefault(worker_id, []).extend(hashes)
        return evictions

    def retry_after_s(self, num_queued: int) -> float:
        """Seconds a rejected client should wait: `num_queued` + 1 requests at the rate
        requests finished lately, clamped to [min_retry_after_s, max_retry_after_s]."""
        c = self.config
        return retry_after_s(num_queued, self._finished.rate(self._clock()),
                             c.min_retry_after_s, c.max_retry_after_s)

    def queue_wait_s(self, num_queued: int) -> float | None:
        """Predicted wait before a request behind `num_queued` others is placed: them and
        it at the rate requests finished lately; None without a recent rate."""
        rate = self._finished.rate(self._clock())
        return None if not rate else (num_queued + 1) / rate

    @property
    def num_indexed_blocks(self) -> int:
        return self.index.num_blocks

    def stats(self) -> RouterStats:
        """A copy of the counters, with the index sizes filled in."""
        s = self._stats
        return RouterStats(s.num_routed, s.num_unplaced, self.index.num_blocks,
                           self.index.num_entries, s.num_tier_blocks, s.num_peer_fetches)

