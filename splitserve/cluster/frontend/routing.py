"""Where a request goes: the router's decision, the admission queue when nothing has room,
and booking the request on its workers the moment it is placed (so the next decision, of
a burst or of the queue, sees that load).

    place(flight)     a new request: route it, or queue it (strict FIFO, bounded: 429)
                      until a load report or a finished request makes room
    claim(flight)     route now or None (what the queue and retries use)
    admit_queued()    capacity may have freed up: place queued requests, oldest first
    any_decoder(...)  a retry's last resort: the least busy decode-capable worker
    check_hit(...)    the routed prefix hit against the one the worker reports
"""
from __future__ import annotations

import asyncio
import logging
import time

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.flight import Flight
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.recovery import stale_hashes
from splitserve.cluster.frontend.worker_table import WorkerInfo
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.workers import Workers
from splitserve.cluster.router.admission import AdmissionQueue
from splitserve.cluster.router.placement import RouteDecision, RouteReason, RouteRequest
from splitserve.cluster.router.router import Router
from splitserve.errors import AdmissionRejected

logger = logging.getLogger(__name__)


class Routing:
    def __init__(self, router: Router, workers: Workers, link: WorkerLink, metrics: Metrics,
                 max_queue_len: int, reject_over_s: float | None = None) -> None:
        self.router, self.workers, self.link, self.metrics = router, workers, link, metrics
        self.queue: AdmissionQueue[Flight] = AdmissionQueue(max_queue_len)
        # Early rejection (--admission reject): a request whose predicted TTFT passes this
        # gets 429 at once rather than a late answer. None: it queues.
        self.reject_over_s = reject_over_s

    async def place(self, flight: Flight) -> RouteDecision:
        """The request's placement, once there is one (the reaper fails a queued request
        at its queue deadline by failing `flight.admitted`)."""
        req = flight.request
        flight.route_req = RouteRequest(
            request_id=req.request_id,
            block_hashes=self.workers.block_hashes(req.namespace, req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids), tenant=req.tenant, disagg=req.disagg)
        # Strict FIFO: while others wait, a newcomer queues behind them.
        decision = None if len(self.queue) else self._decide(flight)
        if self.reject_over_s is not None:
            self._reject_early(decision)
        if decision is not None:
            self._commit(flight, decision)
        else:
            if not self.queue.offer(flight):
                self.metrics.admission_rejections.labels("429").inc()
                raise AdmissionRejected(
                    f"server overloaded: {len(self.queue)} requests already queued",
                    retry_after_s=self.router.retry_after_s(len(self.queue)))
            flight.admitted = asyncio.get_running_loop().create_future()
            try:
                decision = await flight.admitted
            finally:
                self.queue.remove(flight)
        return decision

    def _reject_early(self, decision: RouteDecision | None) -> None:
        """AdmissionRejected (429) when the request would miss its TTFT target anyway
        (Mooncake's early rejection): the router's prediction for where it was placed
        (queue, prefill, transfer, first step), or, when it must queue, the wait for the
        requests ahead at the rate requests finish (no recent rate: no prediction, no
        rejection). Capacity that could arrive in time is not counted: no worker starts
        on demand yet."""
        assert self.reject_over_s is not None
        predicted = (decision.predicted_s if decision is not None
                     else self.router.queue_wait_s(len(self.queue)))
        if predicted is None or predicted <= self.reject_over_s:
            return
        self.metrics.admission_rejections.labels("early").inc()
        raise AdmissionRejected(
            f"predicted time to first token {predicted:.1f} s exceeds the target "
            f"{self.reject_over_s:g} s", retry_after_s=self.router.retry_after_s(len(self.queue)))

    def claim(self, flight: Flight) -> RouteDecision | None:
        """Routes the request and, when placed, books it on its workers at once."""
        decision = self._decide(flight)
        if decision is not None:
            self._commit(flight, decision)
        return decision

    def _decide(self, flight: Flight) -> RouteDecision | None:
        assert flight.route_req is not None
        t0 = time.perf_counter()
        decision = self.router.route(flight.route_req)
        self.metrics.router_seconds.observe(time.perf_counter() - t0)
        return decision

    def _commit(self, flight: Flight, decision: RouteDecision) -> None:
        self.metrics.router_decisions.labels(decision.reason.name.lower()).inc()
        if logger.isEnabledFor(logging.DEBUG):  # --log-level debug: one line per placement
            assert flight.route_req is not None
            logger.debug("placed %s (%d prompt tokens, attempt %d): prefill on %s, decode "
                         "on %s, %s, %d cached, predicted TTFT %.2f s",
                         flight.route_req.request_id, flight.route_req.num_prompt_tokens,
                         flight.attempt, decision.prefill_worker or decision.decode_worker,
                         decision.decode_worker, decision.reason.name.lower(),
                         decision.num_cached_tokens, decision.predicted_s)
        self._book(flight, decision)
        if flight.attempt == 0 and decision.peer is None:  # a peer's prefix is not cached
            flight.expected_hit = decision.num_cached_tokens
        for worker_id, hashes in self.router.take_evictions().items():
            worker = self.workers.table.by_id.get(worker_id)
            if worker is not None and hashes:
                self.link.send(worker.identity, P.EvictBlocks(hashes))

    def admit_queued(self) -> None:
        if not len(self.queue):
            return
        for flight, decision in self.queue.pop_ready(self.claim):
            if flight.admitted is not None and not flight.admitted.done():
                flight.admitted.set_result(decision)

    def any_decoder(self, flight: Flight) -> RouteDecision | None:
        """A retry does not queue behind new arrivals: when the router finds no placement
        within budget, the least busy decode-capable worker prefills and decodes."""
        workers = self.workers.decoders()
        if not workers:
            return None
        worker = min(workers, key=lambda w: len(w.request_ids))
        decision = RouteDecision(worker.worker_id, None, RouteReason.FORCED_LOCAL, 0.0, 0)
        self._book(flight, decision)
        return decision

    def _book(self, flight: Flight, decision: RouteDecision) -> None:
        assert flight.route_req is not None
        self.router.on_dispatched(decision, flight.route_req)
        flight.decision = decision

    def check_hit(self, flight: Flight, worker: WorkerInfo, num_cached: int) -> None:
        """On the first output of the worker that prefills: if it had less of the prompt
        cached than the router expected, drop the index entries the router relied on and
        ask the worker for a snapshot to reconcile (DESIGN 7: a stale directory)."""
        if flight.expected_hit is None or worker.identity != self._prefiller(flight):
            return
        stale = stale_hashes(flight, num_cached, self.workers.block_size)
        flight.expected_hit = None
        if stale:
            self.metrics.stale_routes.inc()
            self.router.invalidate(worker.worker_id, stale)
            self.link.send(worker.identity, P.ResyncKV())

    def _prefiller(self, flight: Flight) -> bytes | None:
        if flight.prefill_worker is not None:
            return flight.prefill_worker
        decode = None if flight.decision is None else self.workers.table.by_id.get(
            flight.decision.decode_worker)
        return None if decode is None else decode.identity
