"""What the frontend does when part of a request's path fails (DESIGN 7).

A request runs as one attempt at a time (cluster/flight.py). When an attempt fails, a new
one starts on other workers under a new id, resuming from the tokens already merged (the
engine replays prompt + those tokens and samples on exactly as the unbroken run would);
with no decode worker up, it waits (within its stage deadline) for a restarted one.

    failure                                  retried?
    worker died or went silent               yes: resume on other workers
    worker error (not a bad request)         yes
    stage stalled (prefill / decode timeout) yes
    KV transfer failed, timed out, corrupt   --kv-failure-policy: recompute (the decode
                                             worker prefills locally, no round trip),
                                             retry (a new attempt, a new transfer), fail
    invalid request, request deadline        no: the client gets the error
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from splitserve import errors
from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.flight import Flight, Stage
from splitserve.cluster.router.placement import RouteDecision, RouteReason
from splitserve.cluster.frontend.worker_table import WorkerInfo
from splitserve.errors import SplitserveError, WorkerFailed

if TYPE_CHECKING:
    from splitserve.cluster.frontend.dispatcher import Dispatcher

logger = logging.getLogger(__name__)

REAPER_PERIOD_S = 0.05

KV_FAILURE_POLICIES = ("recompute", "retry", "fail")


def _subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    sub: type
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


# Error class names a worker reports when a KV transfer or import failed.
TRANSFER_FAILURES = frozenset(c.__name__ for c in _subclasses(errors.KVTransferError)
                              | {errors.KVTransferError, errors.KVImportError})


def is_transfer_failure(kind: str) -> bool:
    return kind in TRANSFER_FAILURES


class Recovery:
    """The dispatcher's failure handling: the reaper (deadlines, heartbeats), retries,
    stranded retries, removed workers, fencing of removed incarnations, stale index
    entries."""

    def __init__(self, dispatcher: Dispatcher, *, max_retries: int,
                 wait_for_restarts: bool) -> None:
        self.d = dispatcher
        self.max_retries = max_retries
        # With no worker to resume on, a retry waits (within its stage deadline) for a
        # restarted one instead of failing at once; set when workers are restarted.
        self.wait_for_restarts = wait_for_restarts
        self.stranded: list[Flight] = []  # retries waiting for a decode worker to register
        self._fenced: set[bytes] = set()  # removed incarnations already told to exit

    def recover(self, flight: Flight, error: SplitserveError, reason: str, *,
                 retryable: bool = True) -> None:
        """The current attempt failed: start another on other workers, resuming from the
        tokens merged so far, while the retry budget and the request deadline allow;
        otherwise the client gets `error`."""
        if flight.is_over:
            return
        if (retryable and flight.attempt < self.max_retries and flight.stage is not Stage.QUEUED
                and time.monotonic() < flight.deadline and self._retry(flight, reason)):
            return
        flight.failed = True
        flight.queue.put_nowait(error)

    def _retry(self, flight: Flight, reason: str) -> bool:
        d = self.d
        old = flight.attempt_id
        d.release(flight)
        d.attempts.pop(old, None)
        aid = flight.next_attempt()
        d.attempts[aid] = flight
        assert flight.route_req is not None
        flight.route_req = replace(flight.route_req, request_id=aid)
        flight.stage = Stage.PREFILL  # until the resumed attempt streams a new token
        flight.stage_deadline = time.monotonic() + d.deadlines.prefill_timeout_s
        d.metrics.retries.labels(reason).inc()
        if flight.resumed:
            d.metrics.migrations.inc()
        decision = d.claim(flight) or self._any_decode_worker(flight)
        if decision is None:
            if not self.wait_for_restarts:
                return False
            logger.warning("request %s: attempt %s failed (%s); no decode worker is up, "
                           "waiting for one", flight.request.request_id, old, reason)
            self.stranded.append(flight)
            return True
        logger.warning("request %s: attempt %s failed (%s); retrying as %s on %s%s, resuming "
                       "after %d tokens", flight.request.request_id, old, reason, aid,
                       decision.decode_worker, f" via {decision.prefill_worker}"
                       if decision.prefill_worker else "", len(flight.resumed))
        d.dispatch(flight, decision)
        return True

    def place_stranded(self) -> None:
        """A worker registered: retries waiting for one go on."""
        d = self.d
        stranded, self.stranded = self.stranded, []
        for flight in stranded:
            if flight.is_over or d.attempts.get(flight.attempt_id) is not flight:
                continue
            decision = d.claim(flight) or self._any_decode_worker(flight)
            if decision is None:
                self.stranded.append(flight)
            else:
                d.dispatch(flight, decision)

    def _any_decode_worker(self, flight: Flight) -> RouteDecision | None:
        """A retry does not queue behind new arrivals: when the router finds no placement
        within budget, the least busy decode-capable worker prefills and decodes."""
        d = self.d
        workers = d.table.healthy(("decode", "both"))
        if not workers:
            return None
        worker = min(workers, key=lambda w: len(w.request_ids))
        decision = RouteDecision(worker.worker_id, None, RouteReason.FORCED_LOCAL, 0.0, 0)
        assert flight.route_req is not None
        d.router.on_dispatched(decision, flight.route_req)
        flight.decision = decision
        return decision

    def check_routed_hit(self, flight: Flight, worker: WorkerInfo, num_cached: int) -> None:
        """The router expected the worker that prefills to have part of the prompt cached;
        if it had less, the index is stale for that worker (DESIGN 7): drop the entries it
        relied on and ask the worker for a snapshot to reconcile."""
        d = self.d
        decision = flight.decision
        prefiller = flight.prefill_worker or (
            None if decision is None else d.table.by_id.get(decision.decode_worker, worker)
            .identity)
        if decision is None or worker.identity != prefiller:
            return
        flight.cache_checked = True
        bs, n = d.block_size, len(flight.request.prompt_token_ids)
        expected = min(decision.num_cached_tokens, (n - 1) // bs * bs)
        if num_cached >= expected:
            return
        assert flight.route_req is not None
        d.metrics.stale_routes.inc()
        d.router.invalidate(worker.worker_id,
                               flight.route_req.block_hashes[num_cached // bs:expected // bs])
        d.link.send(worker.identity, P.ResyncKV())

    def fence(self, identity: bytes) -> None:
        """A message from an incarnation that was removed (it went silent, then woke up) or
        replaced: refused; the first time, the worker is told to exit, so its supervisor
        starts a fresh incarnation instead of a split brain."""
        d = self.d
        d.metrics.fenced_messages.inc()
        if identity not in self._fenced:
            self._fenced.add(identity)
            logger.warning("refusing messages from %r, a removed or replaced worker "
                           "incarnation; telling it to exit", identity)
            d.link.send(identity, P.Shutdown())

    def remove_worker(self, identity: bytes, why: str) -> list[str]:
        """Forgets a worker; the attempt ids it was running and had not finished."""
        d = self.d
        worker = d.table.remove(identity)
        if worker is None:
            return []
        logger.error("worker %s %s; removing it", worker.worker_id, why)
        worker.healthy = False
        d.router.remove_worker(worker.worker_id)
        d.metrics.failures.labels("worker_dead").inc()
        d.metrics.count_workers([(w.role, w.healthy) for w in d.table.workers.values()])
        return [aid for aid in worker.request_ids
                if aid in d.attempts and d.attempts[aid].needs(identity)]

    def recover_all(self, attempt_ids: list[str], why: str) -> None:
        d = self.d
        for aid in attempt_ids:
            flight = d.attempts.get(aid)
            if flight is not None:
                self.recover(flight, WorkerFailed(why), "worker_dead")

    async def reaper_loop(self) -> None:
        """Every 50 ms: requests past a deadline (queue: fail; a stalled stage: retry;
        the request deadline: fail) and workers past their heartbeat deadline."""
        d = self.d
        while True:
            await asyncio.sleep(REAPER_PERIOD_S)
            now = time.monotonic()
            for flight in list(d.flights.values()):
                error = flight.overdue(now, d.deadlines.queue_timeout_s)
                if error is None:
                    continue
                d.metrics.failures.labels(f"timeout_{error.stage}").inc()
                if flight.stage is Stage.QUEUED:
                    assert flight.admitted is not None
                    flight.admitted.set_exception(error)
                else:
                    self.recover(flight, error, f"timeout_{error.stage}",
                                 retryable=error.stage != "request")
            for worker in d.table.overdue(d.deadlines.heartbeat_timeout_s, now):
                self.mark_dead(worker.identity, "missed its heartbeat deadline")

    def mark_dead(self, identity: bytes, why: str) -> None:
        """Takes a worker out of routing and recovers the requests it held: each is
        retried elsewhere (resuming its stream) or fails with WorkerFailed."""
        worker = self.d.table.get(identity)
        if worker is not None and worker.healthy:
            self.recover_all(self.remove_worker(identity, why),
                             f"worker {worker.worker_id} {why}")
