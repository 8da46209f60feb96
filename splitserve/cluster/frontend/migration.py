"""Live migration: a decoding request moves to another decode worker with its KV, exactly
and without recomputing (DESIGN 9, "drain a worker").

    frontend --Migrate--> source: stops the request after the tokens it streamed, holds
                                  the KV of the prompt and of every computed output token
    source --Detached--> frontend --Generate(await_kv, resume = tokens but the last)--> target
    target --KVPlanReady--> frontend --KVPlan--> source --KV--> target: decodes on
    source --PrefillDone--> frontend (the source holds nothing more)

From the source's answer on, the request is the handoff the cluster already knows: the
source plays the prefill worker whose token (the last one it streamed) already reached
the client, the target the decode worker, under the same attempt id; failures go through
the same paths (the target recomputes a failed import, exactly; a dead source or target
fails the attempt, which retries by replay). Everything the source streamed before
Detached was merged first: one socket, in order.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.flight import Flight, FlightState, FlightTable
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.worker_table import WorkerInfo, WorkerTable
from splitserve.cluster.protocol import FailureKind
from splitserve.cluster.router.placement import RouteDecision
from splitserve.cluster.router.router import Router
from splitserve.config import DeadlineConfig
from splitserve.errors import SplitserveError, WorkerFailed

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Move:
    source: bytes
    target: bytes


class Migrations:
    def __init__(self, flights: FlightTable, table: WorkerTable, link: WorkerLink,
                 router: Router, metrics: Metrics, deadlines: DeadlineConfig,
                 hold: Callable[[Flight, WorkerInfo], None],
                 fail_attempt: Callable[[Flight, FailureKind, SplitserveError], None]) -> None:
        self.flights, self.table, self.link, self.router = flights, table, link, router
        self.metrics, self.deadlines = metrics, deadlines
        self._hold, self._fail_attempt = hold, fail_attempt
        self._moves: dict[str, _Move] = {}  # attempt id -> asked, no Detached yet

    def is_moving(self, flight: Flight) -> bool:
        return flight.attempt_id in self._moves

    def decode_worker(self, flight: Flight) -> WorkerInfo | None:
        """The worker the request decodes on now (None before it decodes)."""
        if flight.state is not FlightState.DECODE or flight.decision is None:
            return None
        return self.table.by_id.get(flight.decision.decode_worker)

    def start(self, flight: Flight, target: WorkerInfo) -> bool:
        """Asks the request's decode worker to hand it to `target`; False when it is not
        decoding, is moving already, or would not move."""
        source = self.decode_worker(flight)
        if (source is None or source.identity == target.identity or self.is_moving(flight)
                or not target.role.can_decode):
            return False
        aid = flight.attempt_id
        self._moves[aid] = _Move(source.identity, target.identity)
        self.link.send(source.identity, P.Migrate(aid, flight.request.namespace,
                                                  self.deadlines.kv_timeout_s))
        return True

    def on_detached(self, worker: WorkerInfo, msg: P.Detached) -> None:
        move = self._moves.pop(msg.request_id, None)
        flight = self.flights.attempt(msg.request_id)
        if move is None or flight is None or move.source != worker.identity:
            return
        if not msg.ok:
            self.metrics.live_migrations.labels("refused").inc()
            logger.info("request %s stays on %s: %s", msg.request_id, worker.worker_id,
                        msg.error)
            return
        target = self.table.get(move.target)
        if target is None or not target.healthy:  # the KV is held: replay elsewhere
            self.metrics.live_migrations.labels("target_gone").inc()
            self._fail_attempt(flight, FailureKind.WORKER_DEAD,
                               WorkerFailed("the migration target left"))
            return
        self._hand_over(flight, worker, target)

    def _hand_over(self, flight: Flight, source: WorkerInfo, target: WorkerInfo) -> None:
        req, aid = flight.request, flight.attempt_id
        tokens = list(flight.merger.token_ids)
        assert flight.decision is not None and flight.route_req is not None
        # The source now plays the prefill worker whose token reached the client already;
        # the router moves the request's load to the target (nothing left to prefill).
        flight.prefill_worker = source.identity
        flight.decision = RouteDecision(target.worker_id, source.worker_id,
                                        flight.decision.reason, 0.0, len(req.prompt_token_ids))
        self.router.on_finished(aid)
        self.router.on_dispatched(flight.decision, flight.route_req)
        self._hold(flight, target)
        self.link.send(target.identity, P.Generate(
            aid, req.prompt_token_ids, req.params, req.namespace, await_kv=True,
            kv_timeout_s=self.deadlines.kv_timeout_s, recompute_on_failure=True,
            resume_token_ids=tokens[:-1], tenant=req.tenant))
        flight.advance(FlightState.HANDOFF, time.monotonic(), self.deadlines)
        self.metrics.live_migrations.labels("moved").inc()
        logger.info("request %s moves from %s to %s after %d tokens", req.request_id,
                    source.worker_id, target.worker_id, len(tokens))

    def forget(self, attempt_id: str) -> None:
        self._moves.pop(attempt_id, None)

    async def drain(self, worker: WorkerInfo, targets: Callable[[], list[WorkerInfo]],
                    timeout_s: float) -> dict[str, int]:
        """Moves every request decoding on `worker` to the least busy of `targets()` until
        it holds nothing (a request still prefilling there moves once it decodes; one
        that finishes meanwhile just ends). The caller took `worker` out of routing
        first. Returns how many moved and how many stayed (the drain timed out, or no
        target was up: they resume by replay when the worker stops)."""
        moved: set[str] = set()
        deadline = time.monotonic() + timeout_s
        while (holding := self._holding(worker)) and time.monotonic() < deadline:
            for flight in holding:
                source = self.decode_worker(flight)
                if self.is_moving(flight) or source is None or source.identity != worker.identity:
                    continue  # not decoding here (yet): it finishes or moves later
                choices = [t for t in targets() if t.identity != worker.identity]
                if choices and self.start(flight, min(choices, key=lambda t: len(t.request_ids))):
                    moved.add(flight.request.request_id)
            await asyncio.sleep(0.02)
        return {"moved": len(moved), "stayed": len(self._holding(worker))}

    def _holding(self, worker: WorkerInfo) -> list[Flight]:
        """The live requests `worker` still holds something for (a moved one until the
        worker said it sent or released its KV: PrefillDone)."""
        return [f for aid in list(worker.request_ids) if (f := self.flights.attempt(aid))
                is not None and worker.identity not in f.done_workers]
