"""The frontend's side of the cluster: admits requests, asks the router where they go,
drives them through the workers and merges their outputs into one stream per request.

    generate(req) --admission--> router.route --+--> P: Prefill            (at once,
                                                 \\-> D: Generate(await_kv)  P first)
    D: KVPlanReady --relayed as KVPlan--> P --KV--> D;  P: PrefillDone
    (peer fetch, peer_fetch.py: H exports a prefix to D, which prefills the rest)
    P: token 1 --\\
    D: tokens 2.. +--> StreamMerger --> StreamDelta --> the HTTP layer

One ZeroMQ ROUTER socket talks to every worker (link.py, protocol.py); who is in the
cluster is workers.py; what each worker message does is worker_messages.py. A reaper task
enforces the request deadline and the per-stage timeouts (queue, prefill, handoff, decode
step) and notices silent workers; nothing waits without a limit. Everything runs in the
frontend's asyncio loop; the router is plain logic called from that loop only.

Failures (DESIGN 7): a worker that dies or goes silent, a prefill that errors, a KV
transfer that fails (under `--kv-failure-policy retry`) or a stalled stage fails the
request's current *attempt*; `fail_attempt` asks the retry policy (recovery.py) and either
starts a new attempt on other workers, resuming from the tokens already merged, or gives
the client the error. Outputs are merged as they arrive, so the resumed stream has each
position exactly once.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import AsyncGenerator
from dataclasses import replace

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.admin import ClusterAdmin
from splitserve.cluster.frontend.delivery import Redelivery
from splitserve.cluster.frontend.flight import Flight, FlightState, FlightTable, Outcome
from splitserve.cluster.frontend.interval import IntervalStats
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.migration import Migrations
from splitserve.cluster.frontend.peer_fetch import PeerFetches
from splitserve.cluster.frontend.routing import Routing
from splitserve.cluster.frontend.recovery import KVFailurePolicy, RetryPolicy
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.cluster.frontend.workers import Workers
from splitserve.cluster.frontend.worker_messages import WorkerMessages
from splitserve.cluster.frontend.worker_table import WorkerInfo
from splitserve.cluster.protocol import FailureKind
from splitserve.cluster.router.placement import RouteDecision
from splitserve.cluster.router.router import Router
from splitserve.config import DeadlineConfig
from splitserve.errors import AdmissionRejected, RequestTimeout, SplitserveError, WorkerFailed

logger = logging.getLogger(__name__)

REAPER_PERIOD_S = 0.05  # the reaper's shortest sleep: how late a deadline can be noticed


class Dispatcher(WorkerMessages):
    def __init__(self, router: Router, deadlines: DeadlineConfig, *,
                 max_queue_len: int = 256, retry: RetryPolicy = RetryPolicy(),
                 fault_injection: bool = False,
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 metrics: Metrics | None = None, control_host: str = "127.0.0.1",
                 reject_early: bool = False) -> None:
        self.router = router
        self.deadlines = deadlines
        self.retry = retry
        self.metrics = metrics or Metrics()
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.link = WorkerLink(self.metrics, control_host)
        self.address = self.link.address
        self.workers = Workers(router, self.link, self.metrics)
        self.table = self.workers.table
        self.flights = FlightTable()
        self.routing = Routing(router, self.workers, self.link, self.metrics, max_queue_len,
                               slo_ttft_s if reject_early else None)
        self.admin = ClusterAdmin(self.table, self.link, self.metrics,
                                  fault_injection=fault_injection)
        self.interval = IntervalStats(time.monotonic(), slo_ttft_s, slo_tpot_s)  # the planner's
        self.migrations = Migrations(self.flights, self.table, self.link, router, self.metrics,
                                     deadlines, self._hold, self.fail_attempt)
        self.peers = PeerFetches(self.table, self.link, self.metrics, self._hold)
        self.delivery = Redelivery(self.link, self.flights, self.fail_attempt, self.mark_dead)
        self.link.on_lost = self.delivery.on_lost  # lost sends fail or are resent
        self._tasks: list[asyncio.Task[None]] = []
        self._reaper_at = 0.0  # monotonic: when the reaper wakes next
        self._reaper_wake = asyncio.Event()  # a request whose own deadline is sooner

    @property
    def max_model_len(self) -> int:
        return self.workers.max_model_len

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.link.receive(self._on_message),
                                           name="dispatcher-receive"),
                       asyncio.create_task(self._reaper(), name="dispatcher-reaper")]

    async def wait_for_workers(self, num_workers: int, timeout_s: float) -> None:
        await self.workers.wait_for(num_workers, timeout_s)

    async def wait_for_worker(self, identity: bytes, timeout_s: float) -> None:
        """Returns once `identity` registered; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while identity not in self.table.workers:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{identity!r} did not register within {timeout_s:g} s")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        for identity in list(self.table.workers):
            self.link.send(identity, P.Shutdown())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.delivery.close()
        for flight in self.flights:
            flight.queue.put_nowait(WorkerFailed("the server is shutting down"))
        self.link.close()

    # -- the request path -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncGenerator[StreamDelta, None]:
        flight = self._admit(request)
        outcome = Outcome.ERROR
        try:
            await self._place(flight)
            yield StreamDelta.placed(len(request.prompt_token_ids))
            while True:
                item = await flight.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    outcome = Outcome(item.finish_reason or "stop")
                    return
        except RequestTimeout:
            outcome = Outcome.TIMEOUT
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = Outcome.ABORT  # the client went away
            raise
        finally:
            self._retire(flight, outcome)

    def _admit(self, request: GenerateRequest) -> Flight:
        """A new request's flight. No decode worker up: 503, unless workers are restarted;
        then it waits for one in the admission queue, as when none has room."""
        if not self.workers.decoders() and not self.retry.wait_for_restarts:
            self.metrics.admission_rejections.labels("503").inc()
            raise AdmissionRejected("no decode worker is up", retry_after_s=5.0,
                                    status_code=503)
        if request.params.seed is None:
            # Drawn here so every worker that touches the request samples identically.
            request.params = replace(request.params, seed=random.getrandbits(63))
        now = time.monotonic()
        timeout = request.timeout_s or self.deadlines.request_timeout_s
        flight = Flight(request, now, now + timeout,
                        min(now + timeout, now + self.deadlines.queue_timeout_s))
        self.flights.add(flight)
        if flight.deadline < self._reaper_at:  # its own timeout, shorter than any stage's
            self._reaper_wake.set()
        self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        return flight

    async def _place(self, flight: Flight) -> None:
        decision = await self.routing.place(flight)
        flight.dispatched_at = time.monotonic()
        self.interval.routed(len(flight.request.prompt_token_ids) - decision.num_cached_tokens)
        self.metrics.queue_time.labels("admission").observe(flight.dispatched_at - flight.arrival)
        flight.advance(FlightState.PREFILL, flight.dispatched_at, self.deadlines)
        self._dispatch(flight, decision)

    def _dispatch(self, flight: Flight, decision: RouteDecision) -> None:
        """Sends the attempt to its workers: for a remote prefill, the prefill worker first
        (its step is the request's way to its first token; the KV plan follows through
        us), then the decode worker, which only has to be ready when the KV comes."""
        req, aid = flight.request, flight.attempt_id
        decode = self.table.by_id[decision.decode_worker]
        remote = decision.prefill_worker is not None
        peer = decision.peer
        self._hold(flight, decode)
        if decision.prefill_worker is not None:
            prefill = self.table.by_id[decision.prefill_worker]
            flight.prefill_worker = prefill.identity
            self._hold(flight, prefill)
            self.link.send(prefill.identity, P.Prefill(
                aid, req.prompt_token_ids, req.params, req.namespace,
                kv_timeout_s=self.deadlines.kv_timeout_s, resume_token_ids=flight.resumed,
                tenant=req.tenant))
        self.link.send(decode.identity, P.Generate(
            aid, req.prompt_token_ids, req.params, req.namespace,
            await_kv=remote or peer is not None, kv_timeout_s=self.deadlines.kv_timeout_s,
            recompute_on_failure=peer is not None
            or self.retry.kv_failure_policy is KVFailurePolicy.RECOMPUTE,
            resume_token_ids=flight.resumed, tenant=req.tenant,
            kv_prefix_end=None if peer is None else peer.num_tokens))
        if peer is not None:
            self.peers.start(flight, peer, self.deadlines.kv_timeout_s)

    def _hold(self, flight: Flight, worker: WorkerInfo) -> None:
        flight.workers.add(worker.identity)
        worker.request_ids.add(flight.attempt_id)

    def _release(self, flight: Flight) -> None:
        """Drops the current attempt everywhere: aborts it on workers still holding it."""
        aid = flight.attempt_id
        if flight.dispatched_at is not None:  # a refused or never placed one served nothing
            self.router.on_finished(aid)
        self.migrations.forget(aid)
        for identity in flight.workers - flight.done_workers:
            self.link.send(identity, P.Abort(aid))
        for identity in flight.workers:
            info = self.table.get(identity)
            if info is not None:
                info.request_ids.discard(aid)

    def _retire(self, flight: Flight, outcome: Outcome) -> None:
        self._release(flight)
        self.flights.remove(flight)
        now, n = time.monotonic(), flight.merger.num_tokens
        if flight.first_token_at is not None and outcome in (Outcome.STOP, Outcome.LENGTH):
            self.interval.finished(flight.first_token_at - flight.arrival,
                                   (now - flight.first_token_at) / (n - 1) if n > 1 else 0.0, n)
        self.metrics.observe_finished(flight, outcome.value, time.monotonic(), self.slo_ttft_s,
                                      self.slo_tpot_s)
        self.routing.admit_queued()

    # -- failures -------------------------------------------------------------------------------
    def fail_attempt(self, flight: Flight, kind: FailureKind, error: SplitserveError) -> None:
        """The current attempt failed: another one, resuming from the tokens merged so far,
        when the retry policy allows and a worker takes it; else the client gets `error`."""
        if flight.is_over:
            return
        self.metrics.failures.labels(kind.value).inc()
        if self.retry.should_retry(flight, kind, time.monotonic()) and self._retry(flight, kind):
            return
        flight.state = FlightState.FAILED
        flight.queue.put_nowait(error)

    def _retry(self, flight: Flight, kind: FailureKind) -> bool:
        old = flight.attempt_id
        self._release(flight)
        aid = self.flights.next_attempt(flight, time.monotonic(), self.deadlines)
        assert flight.route_req is not None
        flight.route_req = replace(flight.route_req, request_id=aid)
        self.metrics.retries.labels(kind.value).inc()
        if flight.resumed:
            self.metrics.migrations.inc()
        decision = self.routing.claim(flight) or self.routing.any_decoder(flight)
        if decision is None:
            if not self.retry.wait_for_restarts:
                return False
            logger.warning("request %s: attempt %s failed (%s); no decode worker is up, "
                           "waiting for one", flight.request.request_id, old, kind.value)
            self.flights.stranded.append(flight)
            return True
        logger.warning("request %s: attempt %s failed (%s); retrying as %s on %s%s, resuming "
                       "after %d tokens", flight.request.request_id, old, kind.value, aid,
                       decision.decode_worker, f" via {decision.prefill_worker}"
                       if decision.prefill_worker else "", len(flight.resumed))
        self._dispatch(flight, decision)
        return True

    def _place_stranded(self) -> None:
        """A worker registered: retries waiting for one go on."""
        stranded, self.flights.stranded = self.flights.stranded, []
        for flight in stranded:
            if self.flights.attempt(flight.attempt_id) is not flight:
                continue
            decision = self.routing.claim(flight) or self.routing.any_decoder(flight)
            if decision is None:
                self.flights.stranded.append(flight)
            else:
                self._dispatch(flight, decision)

    def mark_dead(self, identity: bytes, why: str) -> None:
        """Takes a worker out of routing and fails the attempts that still need it: each
        is retried elsewhere (resuming its stream) or fails with WorkerFailed."""
        worker = self.table.get(identity)
        if worker is not None and worker.healthy:
            self._orphan(self.workers.leave(identity, why), f"worker {worker.worker_id} {why}")

    def _orphan(self, worker: WorkerInfo | None, why: str) -> None:
        if worker is None:
            return
        for aid in list(worker.request_ids):
            flight = self.flights.attempt(aid)
            if flight is None:
                continue
            if flight.needs(worker.identity):
                self.fail_attempt(flight, FailureKind.WORKER_DEAD, WorkerFailed(why))
            else:
                self.peers.on_lost(flight, worker.identity)

    async def _reaper(self) -> None:
        """Requests past a deadline (queue: fail; a stalled stage: retry; the request
        deadline: fail) and workers past their heartbeat deadline. It sleeps until the
        earliest deadline there is (at least REAPER_PERIOD_S), at most the shortest
        configured timeout, since a deadline armed while it sleeps (a stage's, a worker's
        heartbeat) is at least that far away; a request's own shorter timeout wakes it
        (`_admit`). An idle or steadily streaming frontend wakes ~once a timeout, not
        20 times a second (each wake-up is CPU taken from the workers on a small machine).
        """
        d = self.deadlines
        max_sleep_s = min(d.queue_timeout_s, d.prefill_timeout_s, d.decode_step_timeout_s,
                          d.kv_timeout_s, d.heartbeat_timeout_s)
        while True:
            now = time.monotonic()
            self._reap(now)
            due = min(min((f.next_due() for f in self.flights), default=math.inf),
                      self.table.next_due(d.heartbeat_timeout_s))
            sleep_s = min(max(due - now, REAPER_PERIOD_S), max_sleep_s)
            self._reaper_at = now + sleep_s
            self._reaper_wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reaper_wake.wait(), sleep_s)

    def _reap(self, now: float) -> None:
        for flight in self.flights:
            overdue = flight.overdue(now, self.deadlines.queue_timeout_s)
            if overdue is None:
                continue
            kind, error = overdue
            if flight.state is FlightState.QUEUED:
                assert flight.admitted is not None
                self.metrics.failures.labels(kind.value).inc()
                flight.admitted.set_exception(error)
            else:
                self.fail_attempt(flight, kind, error)
        for worker in self.table.overdue(self.deadlines.heartbeat_timeout_s, now):
            self.mark_dead(worker.identity, "missed its heartbeat deadline")

    async def drain(self, worker_id: str, timeout_s: float) -> dict[str, int]:
        """Takes a worker out of routing and moves its decoding requests to the other
        decode workers with their KV (migration.py); the caller then stops it (what did
        not move in time resumes elsewhere by replay). KeyError for an unknown worker."""
        worker = self.table.by_id.get(worker_id)
        if worker is None:
            raise KeyError(f"no worker {worker_id!r}; workers: {sorted(self.table.by_id)}")
        worker.draining = True
        self.router.remove_worker(worker_id)
        self.workers.count()
        return await self.migrations.drain(worker, self.workers.decoders, timeout_s)

    # -- what the HTTP layer asks besides requests ----------------------------------------------
    def is_ready(self) -> bool:
        return bool(self.workers.decoders())

    def health(self) -> dict[str, object]:
        return {"workers": self.workers.health(), "in_flight": len(self.flights),
                "queued": len(self.routing.queue)}

    def metrics_text(self) -> bytes:
        return self.metrics.text()
