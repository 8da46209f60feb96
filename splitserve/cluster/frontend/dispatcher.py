"""The frontend's side of the cluster: admits requests, asks the router where they go,
drives them through the workers and merges their outputs into one stream per request.

    generate(req) --admission--> router.route --> decode worker D: Generate(await_kv)
                                              \\-> D answers KVPlanReady --> prefill worker
                                                  P: Prefill(plan) --> P streams KV to D
    P's first token --\\
    D's tokens --------+--> StreamMerger --> StreamDelta --> the HTTP layer

One ZeroMQ ROUTER socket talks to every worker (worker_link.py, protocol.py). A reaper task
enforces the request deadline and the per-stage timeouts (queue, prefill, KV, decode
step) and notices silent workers; nothing waits without a limit. The dispatcher runs in
the frontend's asyncio loop; the router is plain logic called from that loop only.

Failures (DESIGN 7): a worker that dies or goes silent, a prefill that errors, a KV
transfer that fails (under `--kv-failure-policy retry`) or a stalled stage fails the
request's current *attempt*; `_recover` starts a new attempt on other workers, resuming
from the tokens already merged (the engine replays prompt + those tokens and samples on
exactly as before), until the retry budget or the request deadline runs out. Outputs are
merged as they arrive, so the resumed stream has each position exactly once.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from splitserve.cluster import protocol as P
from splitserve.cluster.router.admission import AdmissionQueue
from splitserve.cluster.frontend.metrics import Metrics
from splitserve.cluster.frontend.admin import ClusterAdmin
from splitserve.cluster.frontend.flight import Flight, Stage
from splitserve.cluster.frontend.recovery import KV_FAILURE_POLICIES, Recovery, is_transfer_failure
from splitserve.cluster.router.router import RouteDecision, Router, RouteRequest
from splitserve.cluster.frontend.membership import router_add_worker, router_observe_load
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta
from splitserve.cluster.frontend.link import WorkerLink
from splitserve.cluster.frontend.worker_table import WorkerInfo, WorkerTable
from splitserve.config import DeadlineConfig
from splitserve.errors import (AdmissionRejected, InvalidRequestError, ProtocolError,
                               RequestTimeout, WorkerFailed)
from splitserve.kv_cache.block_hash import hash_full_blocks, root_hash

logger = logging.getLogger(__name__)



class Dispatcher:
    def __init__(self, router: Router, deadlines: DeadlineConfig, *,
                 max_queue_len: int = 256, kv_failure_policy: str = "recompute",
                 max_retries: int = 2, fault_injection: bool = False,
                 wait_for_restarts: bool = False,
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 metrics: Metrics | None = None) -> None:
        if kv_failure_policy not in KV_FAILURE_POLICIES:
            raise ValueError(f"kv_failure_policy={kv_failure_policy!r} is not one of "
                             f"{', '.join(KV_FAILURE_POLICIES)}")
        self.router = router
        self.deadlines = deadlines
        self.max_queue_len = max_queue_len
        self.kv_failure_policy = kv_failure_policy
        self.metrics = metrics or Metrics()
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.table = WorkerTable()
        self.flights: dict[str, Flight] = {}  # by request id
        self.attempts: dict[str, Flight] = {}  # by the current attempt's id (what workers use)
        self.recovery = Recovery(self, max_retries=max_retries,
                                 wait_for_restarts=wait_for_restarts)
        self.admission: AdmissionQueue[Flight] = AdmissionQueue(max_queue_len)
        self.max_model_len = 0
        self.block_size = 16
        self.link = WorkerLink()
        self.address = self.link.address
        self.admin = ClusterAdmin(self.table, self.link, self.metrics,
                                  fault_injection=fault_injection)
        self._registered = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._roots: dict[str | None, bytes] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.link.receive(self._on_message),
                                           name="dispatcher-receive"),
                       asyncio.create_task(self.recovery.reaper_loop(), name="dispatcher-reaper")]

    async def wait_for_workers(self, num_workers: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.table.workers) < num_workers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(self.table.workers)} of {num_workers} workers "
                                   f"registered within {timeout_s:g} s")
            self._registered.clear()
            try:
                await asyncio.wait_for(self._registered.wait(), min(left, 1.0))
            except TimeoutError:
                pass

    async def close(self) -> None:
        for identity in list(self.table.workers):
            self.link.send(identity, P.Shutdown())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for flight in self.flights.values():
            flight.queue.put_nowait(WorkerFailed("the server is shutting down"))
        self.link.close()

    # -- the request path -----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamDelta]:
        flight = self._admit(request)
        outcome = "error"
        try:
            await self._place(flight)
            while True:
                item = await flight.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    outcome = item.finish_reason or "stop"
                    return
        except RequestTimeout:
            outcome = "timeout"
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "abort"  # the client went away
            raise
        finally:
            self._retire(flight, outcome)

    def _admit(self, request: GenerateRequest) -> Flight:
        rid, n = request.request_id, len(request.prompt_token_ids)
        if rid in self.flights:
            raise InvalidRequestError(f"request id {rid!r} is already in flight",
                                      field="request_id")
        if n == 0:
            raise InvalidRequestError("prompt is empty", field="prompt")
        if self.max_model_len and n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, leaving no room to generate within max_model_len="
                f"{self.max_model_len}; shorten it or raise --max-model-len", field="prompt")
        if not self.table.healthy(("decode", "both")):
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
        self.flights[rid] = self.attempts[rid] = flight
        self.metrics.prompt_tokens.inc(n)
        return flight

    async def _place(self, flight: Flight) -> None:
        req = flight.request
        flight.route_req = RouteRequest(
            request_id=req.request_id, block_hashes=self._hashes(req),
            num_prompt_tokens=len(req.prompt_token_ids), max_tokens=req.params.max_tokens,
            tenant=req.tenant)
        # Strict FIFO: while others wait, a newcomer queues behind them.
        decision = None if len(self.admission) else self.claim(flight)
        if decision is None:
            if not self.admission.offer(flight):
                self.metrics.admission_rejections.labels("429").inc()
                raise AdmissionRejected(
                    f"server overloaded: {len(self.admission)} requests already queued",
                    retry_after_s=self.router.retry_after_s(len(self.admission)))
            flight.admitted = asyncio.get_running_loop().create_future()
            try:
                decision = await flight.admitted  # the reaper fails it at the queue deadline
            finally:
                self.admission.remove(flight)
        flight.dispatched_at = time.monotonic()
        self.metrics.queue_time.labels("admission").observe(flight.dispatched_at - flight.arrival)
        flight.stage = Stage.PREFILL
        flight.stage_deadline = time.monotonic() + self.deadlines.prefill_timeout_s
        self.dispatch(flight, decision)

    def claim(self, flight: Flight) -> RouteDecision | None:
        """Routes the request and, when placed, books it on its workers at once, so the
        next decision (of a burst, or of the queue) sees that load."""
        assert flight.route_req is not None
        t0 = time.perf_counter()
        decision = self.router.route(flight.route_req)
        self.metrics.router_seconds.observe(time.perf_counter() - t0)
        if decision is None:
            return None
        self.metrics.router_decisions.labels(decision.reason.name.lower()).inc()
        self.router.on_dispatched(decision, flight.route_req)
        flight.decision = decision
        for worker_id, hashes in self.router.take_evictions().items():
            worker = self.table.by_id.get(worker_id)
            if worker is not None and hashes:
                self.link.send(worker.identity, P.EvictBlocks(hashes))
        return decision

    def _admit_queued(self) -> None:
        """Capacity may have freed up: place queued requests, oldest first."""
        if not len(self.admission):
            return
        for flight, decision in self.admission.pop_ready(self.claim):
            if flight.admitted is not None and not flight.admitted.done():
                flight.admitted.set_result(decision)

    def dispatch(self, flight: Flight, decision: RouteDecision) -> None:
        req, aid = flight.request, flight.attempt_id
        decode = self.table.by_id[decision.decode_worker]
        remote = decision.prefill_worker is not None
        if decision.prefill_worker is not None:
            flight.prefill_worker = self.table.by_id[decision.prefill_worker].identity
        flight.workers.add(decode.identity)
        decode.request_ids.add(aid)
        self.link.send(decode.identity, P.Generate(
            aid, req.prompt_token_ids, req.params, req.namespace, await_kv=remote,
            kv_timeout_s=self.deadlines.kv_timeout_s,
            recompute_on_failure=self.kv_failure_policy == "recompute",
            resume_token_ids=flight.resumed))

    def _on_kv_plan(self, worker: WorkerInfo, msg: P.KVPlanReady) -> None:
        flight = self.attempts.get(msg.request_id)
        if flight is None or flight.prefill_worker is None or flight.is_over \
                or worker.identity not in flight.workers:
            return
        prefill = self.table.get(flight.prefill_worker)
        if prefill is None or not prefill.healthy:
            self.recovery.recover(flight, WorkerFailed("the prefill worker left before the KV plan"),
                          "worker_dead")
            return
        req = flight.request
        flight.workers.add(prefill.identity)
        prefill.request_ids.add(msg.request_id)
        self.link.send(prefill.identity, P.Prefill(msg.request_id, req.prompt_token_ids,
                                               req.params, req.namespace, msg.plan,
                                               flight.resumed))

    def release(self, flight: Flight) -> None:
        """Drops the current attempt everywhere: aborts it on workers still running it."""
        aid = flight.attempt_id
        if flight in self.recovery.stranded:
            self.recovery.stranded.remove(flight)
        self.router.on_finished(aid)
        for identity in flight.workers - flight.done_workers:
            self.link.send(identity, P.Abort(aid))
        for identity in flight.workers:
            info = self.table.get(identity)
            if info is not None:
                info.request_ids.discard(aid)

    def _on_delta(self, flight: Flight, delta: StreamDelta) -> None:
        now = time.monotonic()
        if delta.token_ids:
            self.metrics.observe_tokens(flight, len(delta.token_ids), now)
            if flight.first_token_at is None:
                flight.first_token_at = now
            flight.last_token_at = now
            flight.stage = Stage.DECODE
            flight.stage_deadline = now + self.deadlines.decode_step_timeout_s

    def _retire(self, flight: Flight, outcome: str) -> None:
        self.flights.pop(flight.request.request_id, None)
        self.attempts.pop(flight.attempt_id, None)
        self.release(flight)
        self.metrics.observe_finished(flight, outcome, time.monotonic(), self.slo_ttft_s,
                                      self.slo_tpot_s)
        self._admit_queued()

    def _hashes(self, req: GenerateRequest) -> list[bytes]:
        fingerprint = self.table.fingerprint
        if fingerprint is None:
            return []
        if req.namespace not in self._roots:
            self._roots[req.namespace] = root_hash(fingerprint, req.namespace)
        return hash_full_blocks(self._roots[req.namespace], req.prompt_token_ids,
                                self.block_size)

    # -- messages from workers ------------------------------------------------------------------
    def _on_message(self, identity: bytes, msg: P.Message) -> None:
        if isinstance(msg, P.WorkerReady):
            self._on_ready(identity, msg)
            return
        worker = self.table.get(identity)
        if worker is None:
            self.recovery.fence(identity)
            return
        worker.last_seen = time.monotonic()
        if isinstance(msg, P.Output):
            self._on_output(worker, msg)
        elif isinstance(msg, P.KVPlanReady):
            self._on_kv_plan(worker, msg)
        elif isinstance(msg, P.RequestFailed):
            self._on_failed(worker, msg)
        elif isinstance(msg, P.LoadReport):
            self._on_load(worker, msg)
        elif isinstance(msg, P.KVEventBatch):
            if not self.router.apply_events(worker.worker_id, msg.seq, msg.events):
                self.link.send(identity, P.ResyncKV())
        elif isinstance(msg, P.KVSnapshot):
            self.router.apply_snapshot(worker.worker_id, msg.seq, msg.block_hashes)
        elif isinstance(msg, P.TransferReport):
            self.metrics.observe_transfer(msg.telemetry, msg.error)
            if (msg.error is not None and msg.telemetry.get("side") == "receiver"
                    and self.kv_failure_policy == "recompute"):
                self.metrics.reprefills.inc()
        elif isinstance(msg, P.PoolReport):
            self.admin.on_pool_report(identity, msg)
        else:
            raise ProtocolError(f"workers do not send {type(msg).__name__}")

    def _on_ready(self, identity: bytes, msg: P.WorkerReady) -> None:
        old = self.table.by_id.get(msg.worker_id)
        orphans: list[str] = []
        if old is not None and old.identity != identity:
            # A restarted worker: its previous incarnation is gone, with its cache; its
            # requests resume once the new one is registered (they may go to it).
            orphans = self.recovery.remove_worker(old.identity, "was replaced")
        self.table.register(identity, msg)
        self.block_size = msg.block_size
        self.max_model_len = (msg.max_model_len if not self.max_model_len
                              else min(self.max_model_len, msg.max_model_len))
        router_add_worker(self.router, msg)
        self.metrics.kv_blocks_total.labels(msg.worker_id).set(msg.num_blocks)
        self.metrics.count_workers([(w.role, w.healthy) for w in self.table.workers.values()])
        logger.info("worker %s registered (pid %d, %d KV blocks)", msg.worker_id, msg.pid,
                    msg.num_blocks)
        self._registered.set()
        self.recovery.recover_all(orphans, f"worker {msg.worker_id} was replaced by a new "
                                           "incarnation")
        self.recovery.place_stranded()
        self._admit_queued()

    def _on_output(self, worker: WorkerInfo, msg: P.Output) -> None:
        flight = self.attempts.get(msg.request_id)
        if flight is None or flight.is_over or worker.identity not in flight.workers:
            return  # a late output of an attempt that was retried, aborted or finished
        if msg.finished:
            flight.done_workers.add(worker.identity)
        if (flight.prefill_worker is not None and worker.identity != flight.prefill_worker
                and not flight.decode_output_seen):
            flight.decode_output_seen = True  # D committed the imported KV
            if flight.first_token_at is not None:
                self.metrics.queue_time.labels("kv").observe(time.monotonic()
                                                             - flight.first_token_at)
        if not flight.cache_checked:
            self.recovery.check_routed_hit(flight, worker, msg.num_cached_tokens)
        try:
            delta = flight.merger.merge(msg)
        except ValueError as exc:  # a worker broke the positions contract: never guess
            self.recovery.recover(flight, WorkerFailed(f"{worker.worker_id}: {exc}"), "bad_output",
                          retryable=False)
            return
        if delta is not None:
            self._on_delta(flight, delta)
            flight.queue.put_nowait(delta)

    def _on_failed(self, worker: WorkerInfo, msg: P.RequestFailed) -> None:
        self.metrics.failures.labels(msg.kind).inc()
        flight = self.attempts.get(msg.request_id)
        if flight is None or worker.identity not in flight.workers:
            return
        flight.done_workers.add(worker.identity)
        if msg.kind == "InvalidRequestError":
            self.recovery.recover(flight, InvalidRequestError(msg.message, field=msg.field), "invalid",
                          retryable=False)
            return
        transfer = is_transfer_failure(msg.kind)
        policy = f" (--kv-failure-policy {self.kv_failure_policy})" if transfer else ""
        self.recovery.recover(flight, WorkerFailed(f"{worker.worker_id}: {msg.kind}: {msg.message}"
                                           f"{policy}"),
                      "kv_transfer" if transfer else "worker_error",
                      retryable=not transfer or self.kv_failure_policy == "retry")

    def _on_load(self, worker: WorkerInfo, msg: P.LoadReport) -> None:
        router_observe_load(self.router, worker.worker_id, worker.ready.max_num_seqs, msg)
        self.metrics.observe_load(worker.worker_id, msg)
        self.metrics.index_blocks.set(self.router.num_indexed_blocks)
        self._admit_queued()

    # -- what the HTTP layer asks besides requests ----------------------------------------------
    def is_ready(self) -> bool:
        return bool(self.table.healthy(("decode", "both")))

    def health(self) -> dict[str, object]:
        return {"workers": [{"id": w.worker_id, "role": w.role, "healthy": w.healthy,
                             "incarnation": w.identity.decode(errors="replace"),
                             "pid": w.ready.pid, "requests": len(w.request_ids)}
                            for w in self.table.workers.values()],
                "in_flight": len(self.flights), "queued": len(self.admission)}

    def metrics_text(self) -> bytes:
        return self.metrics.text()

