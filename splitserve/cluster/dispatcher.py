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
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from splitserve.cluster import protocol as P
from splitserve.cluster.admission import AdmissionQueue
from splitserve.cluster.metrics import Metrics
from splitserve.cluster.flight import Flight, Stage
from splitserve.cluster.router import Role, RouteDecision, Router, RouteRequest, WorkerLoad
from splitserve.cluster.stream import GenerateRequest, StreamDelta
from splitserve.cluster.worker_link import WorkerLink
from splitserve.cluster.worker_table import WorkerInfo, WorkerTable
from splitserve.config import DeadlineConfig
from splitserve.errors import (AdmissionRejected, InvalidRequestError, ProtocolError,
                               RequestTimeout, WorkerFailed)
from splitserve.kv_cache.block_hash import hash_full_blocks, root_hash

logger = logging.getLogger(__name__)

REAPER_PERIOD_S = 0.05
_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE, "both": Role.BOTH}


class Dispatcher:
    def __init__(self, router: Router, deadlines: DeadlineConfig, *,
                 max_queue_len: int = 256, recompute_on_kv_failure: bool = True,
                 slo_ttft_s: float | None = None, slo_tpot_s: float | None = None,
                 metrics: Metrics | None = None) -> None:
        self.router = router
        self.deadlines = deadlines
        self.max_queue_len = max_queue_len
        self.recompute_on_kv_failure = recompute_on_kv_failure
        self.metrics = metrics or Metrics()
        self.slo_ttft_s, self.slo_tpot_s = slo_ttft_s, slo_tpot_s
        self.table = WorkerTable()
        self.flights: dict[str, Flight] = {}
        self.admission: AdmissionQueue[Flight] = AdmissionQueue(max_queue_len)
        self.max_model_len = 0
        self.block_size = 16
        self.link = WorkerLink()
        self.address = self.link.address
        self._registered = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._roots: dict[str | None, bytes] = {}

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.link.receive(self._on_message),
                                           name="dispatcher-receive"),
                       asyncio.create_task(self._reaper_loop(), name="dispatcher-reaper")]

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
                delta = flight.merger.merge(item)
                if delta is None:
                    continue
                self._on_delta(flight, delta)
                yield delta
                if delta.finished:
                    outcome = delta.finish_reason or "stop"
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
        self.flights[rid] = flight
        self.metrics.prompt_tokens.inc(n)
        return flight

    async def _place(self, flight: Flight) -> None:
        req = flight.request
        flight.route_req = RouteRequest(
            request_id=req.request_id, block_hashes=self._hashes(req),
            num_prompt_tokens=len(req.prompt_token_ids), max_tokens=req.params.max_tokens,
            tenant=req.tenant)
        # Strict FIFO: while others wait, a newcomer queues behind them.
        decision = None if len(self.admission) else self._claim(flight)
        if decision is None:
            if not self.admission.offer(flight, time.monotonic()):
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
        self._dispatch(flight, decision)

    def _claim(self, flight: Flight) -> RouteDecision | None:
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
        for flight, decision in self.admission.pop_ready(self._claim, time.monotonic()):
            if flight.admitted is not None and not flight.admitted.done():
                flight.admitted.set_result(decision)

    def _dispatch(self, flight: Flight, decision: RouteDecision) -> None:
        req = flight.request
        decode = self.table.by_id[decision.decode_worker]
        remote = decision.prefill_worker is not None
        if decision.prefill_worker is not None:
            flight.prefill_worker = self.table.by_id[decision.prefill_worker].identity
        flight.workers.add(decode.identity)
        decode.request_ids.add(req.request_id)
        self.link.send(decode.identity, P.Generate(
            req.request_id, req.prompt_token_ids, req.params, req.namespace, await_kv=remote,
            kv_timeout_s=self.deadlines.kv_timeout_s,
            recompute_on_failure=self.recompute_on_kv_failure))

    def _on_kv_plan(self, msg: P.KVPlanReady) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None or flight.prefill_worker is None:
            return
        prefill = self.table.get(flight.prefill_worker)
        if prefill is None or not prefill.healthy:
            flight.queue.put_nowait(WorkerFailed("the prefill worker left before the KV plan"))
            return
        req = flight.request
        flight.workers.add(prefill.identity)
        prefill.request_ids.add(req.request_id)
        self.link.send(prefill.identity, P.Prefill(req.request_id, req.prompt_token_ids,
                                               req.params, req.namespace, msg.plan))

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
        rid = flight.request.request_id
        self.flights.pop(rid, None)
        self.router.on_finished(rid)
        for identity in flight.workers - flight.done_workers:
            self.link.send(identity, P.Abort(rid))
        for identity in flight.workers:
            info = self.table.get(identity)
            if info is not None:
                info.request_ids.discard(rid)
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
            raise ProtocolError("message from an unregistered or replaced worker")
        worker.last_seen = time.monotonic()
        if isinstance(msg, P.Output):
            self._on_output(worker, msg)
        elif isinstance(msg, P.KVPlanReady):
            self._on_kv_plan(msg)
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
        else:
            raise ProtocolError(f"workers do not send {type(msg).__name__}")

    def _on_ready(self, identity: bytes, msg: P.WorkerReady) -> None:
        self.table.register(identity, msg)
        self.block_size = msg.block_size
        cfg = self.router.config
        if (cfg.kv_bytes_per_token, cfg.block_size) != (msg.kv_bytes_per_token, msg.block_size):
            # The workers know the model's KV size (layers, heads, dtype); the router's
            # transfer-time estimate uses it.
            self.router.config = replace(cfg, kv_bytes_per_token=msg.kv_bytes_per_token,
                                         block_size=msg.block_size)
        self.max_model_len = (msg.max_model_len if not self.max_model_len
                              else min(self.max_model_len, msg.max_model_len))
        self.router.add_worker(msg.worker_id, _ROLES[msg.role], WorkerLoad(
            0, 0, 0, 0, msg.num_blocks, msg.max_num_seqs))
        self.metrics.kv_blocks_total.labels(msg.worker_id).set(msg.num_blocks)
        self.metrics.count_workers([(w.role, w.healthy) for w in self.table.workers.values()])
        logger.info("worker %s registered (pid %d, %d KV blocks)", msg.worker_id, msg.pid,
                    msg.num_blocks)
        self._registered.set()
        self._admit_queued()

    def _on_output(self, worker: WorkerInfo, msg: P.Output) -> None:
        flight = self.flights.get(msg.request_id)
        if flight is None:
            return
        if msg.finished:
            flight.done_workers.add(worker.identity)
        if (flight.prefill_worker is not None and worker.identity != flight.prefill_worker
                and not flight.decode_output_seen):
            flight.decode_output_seen = True  # D committed the imported KV
            if flight.first_token_at is not None:
                self.metrics.queue_time.labels("kv").observe(time.monotonic()
                                                             - flight.first_token_at)
        flight.queue.put_nowait(msg)

    def _on_failed(self, worker: WorkerInfo, msg: P.RequestFailed) -> None:
        self.metrics.failures.labels(msg.kind).inc()
        flight = self.flights.get(msg.request_id)
        if flight is None:
            return
        flight.done_workers.add(worker.identity)
        error: Exception
        if msg.kind == "InvalidRequestError":
            error = InvalidRequestError(msg.message, field=msg.field)
        else:
            error = WorkerFailed(f"{worker.worker_id}: {msg.kind}: {msg.message}")
        flight.queue.put_nowait(error)

    def _on_load(self, worker: WorkerInfo, msg: P.LoadReport) -> None:
        wid = worker.worker_id
        load = WorkerLoad(msg.num_running, msg.num_waiting + msg.num_awaiting_kv,
                          msg.num_waiting_tokens, msg.kv_blocks_used, msg.kv_blocks_total,
                          worker.ready.max_num_seqs)
        self.router.update_load(wid, load)
        for num_prefill, num_decode, seconds in msg.steps:
            if num_prefill and not num_decode:
                self.router.observe_prefill(wid, int(num_prefill), seconds)
            elif num_decode and not num_prefill:
                self.router.observe_decode_step(wid, int(num_decode), seconds)
        self.metrics.observe_load(wid, msg)
        self.metrics.index_blocks.set(self.router.num_indexed_blocks)
        self._admit_queued()

    # -- deadlines and health -------------------------------------------------------------------
    async def _reaper_loop(self) -> None:
        while True:
            await asyncio.sleep(REAPER_PERIOD_S)
            now = time.monotonic()
            for flight in list(self.flights.values()):
                error = flight.overdue(now, self.deadlines.queue_timeout_s)
                if error is None:
                    continue
                self.metrics.failures.labels(f"timeout_{error.stage}").inc()
                if flight.stage is Stage.QUEUED:
                    assert flight.admitted is not None
                    flight.admitted.set_exception(error)
                else:
                    flight.queue.put_nowait(error)
            for worker in self.table.overdue(self.deadlines.heartbeat_timeout_s, now):
                self.mark_dead(worker.identity, "missed its heartbeat deadline")

    def mark_dead(self, identity: bytes, why: str) -> None:
        """Takes a worker out of routing and fails the requests it held."""
        worker = self.table.get(identity)
        if worker is None or not worker.healthy:
            return
        logger.error("worker %s %s; removing it", worker.worker_id, why)
        worker.healthy = False
        self.router.remove_worker(worker.worker_id)
        self.metrics.failures.labels("worker_dead").inc()
        for rid in list(worker.request_ids):
            flight = self.flights.get(rid)
            if flight is not None:
                flight.queue.put_nowait(WorkerFailed(f"worker {worker.worker_id} {why}"))
        self.table.remove(identity)
        self.metrics.count_workers([(w.role, w.healthy) for w in self.table.workers.values()])


    # -- what the HTTP layer asks besides requests ----------------------------------------------
    def is_ready(self) -> bool:
        if self.table.healthy(("both",)):
            return True
        return bool(self.table.healthy(("decode",)))

    def health(self) -> dict[str, object]:
        return {"workers": [{"id": w.worker_id, "role": w.role, "healthy": w.healthy,
                             "pid": w.ready.pid, "requests": len(w.request_ids)}
                            for w in self.table.workers.values()],
                "in_flight": len(self.flights), "queued": len(self.admission)}

    def metrics_text(self) -> bytes:
        return self.metrics.text()

