"""What the frontend does with each message a worker sends: outputs merged into their
request's stream, a decode worker's KV plan relayed to the prefill worker, prefill and
failure notices turned into the request's next state or its next attempt, load reports,
KV events and snapshots into the router's index, transfer telemetry into the metrics.
Mixed into Dispatcher (dispatcher.py), which owns the request path and its failures."""
from __future__ import annotations

import time

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.admin import ClusterAdmin
from splitserve.cluster.frontend.flight import Flight, FlightState, FlightTable
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.migration import Migrations
from splitserve.cluster.frontend.peer_fetch import PeerFetches
from splitserve.cluster.frontend.recovery import KVFailurePolicy, RetryPolicy
from splitserve.cluster.frontend.routing import Routing
from splitserve.cluster.frontend.stream import DivergedOutput
from splitserve.cluster.frontend.worker_table import WorkerInfo, WorkerTable
from splitserve.cluster.frontend.workers import Workers
from splitserve.cluster.protocol import FailureKind
from splitserve.cluster.router.router import Router
from splitserve.config import DeadlineConfig
from splitserve.errors import InvalidRequestError, ProtocolError, SplitserveError, WorkerFailed
from splitserve.store.block import TierName


class WorkerMessages:
    """Dispatcher's message handlers; Dispatcher's constructor sets what is declared here."""
    router: Router
    deadlines: DeadlineConfig
    retry: RetryPolicy
    metrics: Metrics
    link: WorkerLink
    workers: Workers
    table: WorkerTable
    flights: FlightTable
    routing: Routing
    admin: ClusterAdmin
    migrations: Migrations
    peers: PeerFetches

    def fail_attempt(self, flight: Flight, kind: FailureKind, error: SplitserveError) -> None:
        raise NotImplementedError  # Dispatcher's: retry elsewhere or fail the request

    def _orphan(self, worker: WorkerInfo | None, why: str) -> None:
        raise NotImplementedError  # Dispatcher's: its requests resume on other workers

    def _place_stranded(self) -> None:
        raise NotImplementedError  # Dispatcher's: requests waiting for a worker get one

    def _on_message(self, identity: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.WorkerReady):
            self._on_ready(identity, msg)
            return
        worker = self.workers.heard_from(identity)
        if worker is None:
            return
        if isinstance(msg, P.Output):
            self._on_output(worker, msg)
        elif isinstance(msg, P.OutputBatch):
            if len(msg.outputs) > P.MAX_OUTPUT_BATCH:
                raise ProtocolError(f"OutputBatch of {len(msg.outputs)} outputs (at most "
                                    f"{P.MAX_OUTPUT_BATCH})")
            for out in msg.outputs:
                self._on_output(worker, out)
        elif isinstance(msg, P.KVPlanReady):
            self._on_kv_plan(worker, msg)
        elif isinstance(msg, P.PrefillDone):
            self._on_prefill_done(worker, msg)
        elif isinstance(msg, P.RequestFailed):
            self._on_failed(worker, msg)
        elif isinstance(msg, P.LoadReport):
            self.workers.observe_load(worker, msg)
            self.routing.admit_queued()
        elif isinstance(msg, (P.KVEventBatch, P.KVSnapshot, P.TierEventBatch)) \
                and worker.draining:
            pass  # out of routing: its cache is no one's prefix hit any more
        elif isinstance(msg, P.KVEventBatch):
            if not self.router.apply_events(worker.worker_id, msg.seq, msg.events):
                self.link.send(identity, P.ResyncKV())
        elif isinstance(msg, P.KVSnapshot):
            self.router.apply_snapshot(worker.worker_id, msg.seq, msg.block_hashes)
        elif isinstance(msg, P.TierEventBatch):
            self.router.apply_tier_events(worker.worker_id, TierName(msg.tier), msg.seq,
                                          msg.events)
        elif isinstance(msg, P.TransferReport):
            self.metrics.observe_transfer(msg.telemetry, recomputes=self.retry.kv_failure_policy
                                          is KVFailurePolicy.RECOMPUTE)
        elif isinstance(msg, (P.PoolReport, P.TenantPurged)):
            self.admin.on_answer(identity, msg)
        elif isinstance(msg, P.Detached):
            self.migrations.on_detached(worker, msg)
        else:  # counted by the link as refused
            raise ProtocolError(f"workers do not send {type(msg).__name__}")

    def _on_ready(self, identity: bytes, msg: P.WorkerReady) -> None:
        # Checked whole first (ProtocolError: refused, nothing changed). A restarted
        # worker: its previous incarnation is gone, with its cache; its requests resume
        # once the new one is registered (they may go to it).
        replaced = self.workers.join(identity, msg)
        self._orphan(replaced, f"worker {msg.worker_id} was replaced by a new incarnation")
        self._place_stranded()
        self.routing.admit_queued()

    def _current(self, worker: WorkerInfo, request_id: str) -> Flight | None:
        """The live flight whose current attempt is `request_id` on this worker; None for
        a late message of an attempt that was retried, aborted or finished."""
        flight = self.flights.attempt(request_id)
        return flight if flight is not None and worker.identity in flight.workers else None

    def _on_kv_plan(self, worker: WorkerInfo, msg: P.KVPlanReady) -> None:
        flight = self._current(worker, msg.request_id)
        if flight is None:
            return
        sender = flight.prefill_worker or flight.peer_worker
        info = None if sender is None else self.table.get(sender)
        if sender is None or sender in flight.done_workers:
            return
        if info is None or not info.healthy:
            if sender == flight.peer_worker:
                self.peers.failed(flight)
            else:
                self.fail_attempt(flight, FailureKind.WORKER_DEAD,
                                  WorkerFailed("the prefill worker left before the KV plan"))
            return
        self.link.send(info.identity, P.KVPlan(msg.request_id, msg.plan))

    def _on_prefill_done(self, worker: WorkerInfo, msg: P.PrefillDone) -> None:
        flight = self._current(worker, msg.request_id)
        if flight is None:
            return
        if worker.identity == flight.peer_worker:
            self.peers.on_done(flight, worker, msg.handed_off)
            return
        flight.done_workers.add(worker.identity)
        if msg.handed_off and flight.first_token_at is not None:
            self.metrics.queue_time.labels("kv").observe(time.monotonic()
                                                         - flight.first_token_at)

    def _on_output(self, worker: WorkerInfo, msg: P.Output) -> None:
        flight = self._current(worker, msg.request_id)
        if flight is None or flight.hold(worker.identity, msg):
            return
        if msg.finished:
            flight.done_workers.add(worker.identity)
            self.router.on_worker_done(worker.worker_id, msg.request_id)
        self.routing.check_hit(flight, worker, msg.num_cached_tokens)
        try:
            delta = flight.merger.merge(msg)
        except DivergedOutput as exc:  # retried from the tokens the client has
            self.fail_attempt(flight, FailureKind.DIVERGED,
                              WorkerFailed(f"{worker.worker_id}: {exc}"))
            return
        except ValueError as exc:  # a worker broke the positions contract: never guess
            self.fail_attempt(flight, FailureKind.BAD_OUTPUT,
                              WorkerFailed(f"{worker.worker_id}: {exc}"))
            return
        now = time.monotonic()
        from_prefill = worker.identity == flight.prefill_worker
        if delta is not None and delta.token_ids:
            self.metrics.observe_tokens(flight, len(delta.token_ids), now)
            if flight.first_token_at is None:
                flight.first_token_at = now
            flight.last_token_at = now
            flight.advance(FlightState.HANDOFF if from_prefill else FlightState.DECODE, now,
                           self.deadlines)
        if delta is not None:
            if delta.finished:
                flight.state = FlightState.FINISHED
            flight.queue.put_nowait(delta)
        if from_prefill and flight.held:  # token 1 is in: the decode worker's outputs go on
            held, flight.held = flight.held, []
            for identity, early in held:
                decode = self.table.get(identity)
                if decode is not None:
                    self._on_output(decode, early)

    def _on_failed(self, worker: WorkerInfo, msg: P.RequestFailed) -> None:
        flight = self._current(worker, msg.request_id)
        if flight is None:
            self.metrics.failures.labels(msg.kind.value).inc()
            return
        if worker.identity == flight.peer_worker:
            self.peers.on_failed(flight, worker, msg)
            return
        flight.done_workers.add(worker.identity)
        error: SplitserveError
        if msg.kind is FailureKind.INVALID_REQUEST:
            error = InvalidRequestError(msg.message, field=msg.field)
        else:
            policy = (f" (--kv-failure-policy {self.retry.kv_failure_policy.value})"
                      if msg.kind is FailureKind.KV_TRANSFER else "")
            error = WorkerFailed(f"{worker.worker_id}: {msg.kind.value}: {msg.message}{policy}")
        self.fail_attempt(flight, msg.kind, error)
