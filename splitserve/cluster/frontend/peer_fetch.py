"""Peer fetch, the frontend's part: a request the router placed on decode worker D with a
`RouteDecision.peer` imports its prompt's prefix from the holder H (its pool or tiers)
and prefills the rest on D (DESIGN 6: peers are a tier; no central data server).

    frontend --Generate(await_kv, kv_prefix_end=N, recompute_on_failure)--> D
             --ExportPrefix(the N-token prefix)--> H: holds it (nothing computed)
    D --KVPlanReady--> frontend --KVPlan--> H --KV--> D: prefills [N, T), streams token 1..
    H --PrefillDone(handed_off)--> frontend

H is never *needed* by the attempt (`Flight.needs`): when it fails, gives up, holds less
than N or dies, D is told to prefill the whole prompt (CancelImport; a no-op if D already
fell back after a failed transfer), and the request goes on. Counted in
`splitserve_kv_peer_fetches_total{outcome}`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.flight import Flight
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.worker_table import WorkerInfo, WorkerTable
from splitserve.cluster.router.placement import PeerFetch

logger = logging.getLogger(__name__)


class PeerFetches:
    def __init__(self, table: WorkerTable, link: WorkerLink, metrics: Metrics,
                 hold: Callable[[Flight, WorkerInfo], None]) -> None:
        self.table, self.link, self.metrics, self._hold = table, link, metrics, hold

    def start(self, flight: Flight, peer: PeerFetch, kv_timeout_s: float) -> None:
        """Asks the holder for the prefix (D's Generate, sent by the caller, awaits it)."""
        req = flight.request
        holder = self.table.by_id[peer.worker]
        flight.peer_worker = holder.identity
        self._hold(flight, holder)
        self.link.send(holder.identity, P.ExportPrefix(
            flight.attempt_id, req.prompt_token_ids[:peer.num_tokens], req.namespace,
            kv_timeout_s, req.tenant))
        self.metrics.peer_fetches.labels("started").inc()
        self.metrics.peer_fetch_tokens.inc(peer.num_tokens)

    def failed(self, flight: Flight) -> None:
        """The holder failed, left or gave up: the decode worker prefills it all."""
        assert flight.peer_worker is not None and flight.decision is not None
        if flight.peer_worker in flight.done_workers:
            return  # told already
        flight.done_workers.add(flight.peer_worker)
        self.metrics.peer_fetches.labels("failed").inc()
        decode = self.table.by_id.get(flight.decision.decode_worker)
        if decode is not None and decode.healthy:
            self.link.send(decode.identity, P.CancelImport(flight.attempt_id))

    def on_done(self, flight: Flight, worker: WorkerInfo, handed_off: bool) -> None:
        """The holder's PrefillDone: its transfer was committed, or it gave up."""
        if handed_off:
            self.metrics.peer_fetches.labels("committed").inc()
            flight.done_workers.add(worker.identity)
        else:
            self.failed(flight)

    def on_failed(self, flight: Flight, worker: WorkerInfo, msg: P.RequestFailed) -> None:
        """The holder's RequestFailed (e.g. it holds less than the prefix now)."""
        logger.warning("request %s: %s could not export its prefix (%s: %s); the decode "
                       "worker prefills it", msg.request_id, worker.worker_id, msg.kind.value,
                       msg.message)
        self.failed(flight)

    def on_lost(self, flight: Flight, identity: bytes) -> None:
        """A worker left: if it is the flight's holder and still owes the prefix."""
        if flight.peer_worker == identity and identity not in flight.done_workers:
            self.failed(flight)
