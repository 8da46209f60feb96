"""A worker process: one engine, driven by messages from the frontend.

    python -m splitserve.cluster.worker '<WorkerSpec as JSON>'

The main thread is the engine thread. Each turn of its loop: take every pending message
(waiting only when there is nothing to compute), run one engine step, move KV (sender
and receiver polls), send outputs (the turn's in one OutputBatch), KV events and,
periodically, a load report that is also the heartbeat. Roles: `prefill` prefills and
streams KV out, `decode` imports KV and decodes, `both` (aggregated) does everything
locally; every role can prefill locally, and every role can hand a decoding request over
with its KV (Migrate: live migration). What each request message does, and the KV and
outputs it moves, is in requests.py.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.heap import freeze_startup_heap, pause_collector
from splitserve.cluster.protocol import FailureKind, FaultSpec
from splitserve.cluster.worker.membership import Membership
from splitserve.cluster.worker.reports import Reports
from splitserve.cluster.worker.requests import RequestHandling
from splitserve.cluster.worker.faults import FaultInjector
from splitserve.cluster.worker.handoff import Handoffs
from splitserve.cluster.worker.lending import Lending
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.cluster.worker.tiers import WorkerStore
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.errors import StepFailed
from splitserve.transfer.faulty import WireFault, WireFaultKind
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender, LayerStreaming, compute_leaves_cores
from splitserve.transfer.transport import get_transport

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # longest sleep with nothing to do (deadlines are checked this often)
BUSY_WAIT_S = 0.002  # sleep while waiting for free blocks to import KV into


class Worker(RequestHandling):
    def __init__(self, spec: WorkerSpec, secret: WorkerSecret) -> None:
        pause_collector()  # until run() freezes the startup heap (heap.py)
        self.spec = spec
        self.engine = LLMEngine(EngineConfig.from_kwargs(**spec.engine_args))
        self.engine.enable_kv_events()  # this worker publishes them (_publish_events)
        # Cores a decode worker lends a prefill worker (lending.py): the exact kernels'
        # helper threads take them; without those kernels there is nothing to lend.
        self.lending = (None if not (spec.leases and self.engine.batch_invariant) else
                        Lending.borrow(spec.borrowed_cores, spec.leases)
                        if spec.borrowed_cores else Lending.lend(spec.leases, spec.pace_s))
        self.store = WorkerStore.build(self.engine, spec.store, secret.store_key)
        # Every role sends KV: prefill workers their prefills, decode workers the running
        # sequences they hand over (live migration, Migrate).
        self.sender = KVSender(self.engine, stream_layers=LayerStreaming(spec.kv_stream_layers),
                               spare_cores=compute_leaves_cores(self.engine.device))
        self.handoffs = Handoffs(self.engine, self.sender)
        self.receiver = (KVReceiver(self.engine, get_transport(spec.kv_transport).listen(
            f"tcp://{spec.kv_host}:0" if spec.kv_transport == "tcp" else None))
            if spec.role.can_decode else None)
        # A CURVE client keyed by `secret` (cluster/auth.py); sends time out when the
        # frontend is gone (then this worker exits, or waits to be adopted: `_send`).
        self.member = Membership(spec, secret)
        self.streams = {}
        self.outbox = []
        self.reserving = {}
        self.reports = Reports(spec.report_interval_s, spec.heartbeat_interval_s)
        self.stopping = False
        self.faults = FaultInjector(spec.fault_injection)

    # -- loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        freeze_startup_heap(self.spec.worker_id)  # before any request can arrive
        self._register()
        parent = os.getppid()
        while not self.stopping:
            self._take_adoption()
            wait_s = self._wait_s()
            if self.lending is not None and wait_s:
                self.lending.busy(False)  # no step before then: the core is lent meanwhile
            self._receive(wait_s)
            self._inject(self.faults.fire("now"))
            stepping = engine.has_unfinished and not self._pause_s()
            if self.lending is not None:
                self.lending.busy(stepping)
            outputs = self._step() if stepping else []
            if outputs:
                self.reports.step_done(engine)
                if self.store is not None:
                    self.store.observe_step(engine.last_step)
            for out in outputs:  # the tokens leave first: a prefill's KV is copied after
                self._output(out)
            self._flush_outputs()
            self._move_kv(outputs)
            self._flush_outputs()
            self._publish_events()
            if self.reports.is_due():
                report = self.reports.load_report(
                    engine, self.receiver, self.store.usage() if self.store else [])
                if report is not None:
                    self._send(report)
                if os.getppid() != parent:  # the frontend died without stopping us
                    logger.warning("parent process is gone; exiting")
                    break
        self.close()

    def _register(self) -> None:
        engine, spec_ = self.engine, self.engine.spec
        self._send(P.WorkerReady(
            worker_id=self.spec.worker_id, role=self.spec.role, pid=os.getpid(),
            fingerprint=engine.fingerprint, block_size=engine.block_size,
            num_blocks=engine.num_blocks, max_model_len=engine.context_limit,
            max_num_seqs=engine.config.scheduler.max_num_seqs,
            max_num_partial_prefills=engine.config.scheduler.max_num_partial_prefills,
            kv_address=self.receiver.address if self.receiver else None,
            kv_bytes_per_token=2 * spec_.num_layers * spec_.num_kv_heads * spec_.head_dim
            * engine.kv_cache.element_size(),
            pace_s=self.lending.pace_s if self.lending else None,
            borrows_cores=bool(self.spec.borrowed_cores and self.lending)))

    # -- a new frontend (Ray runtime: workers outlive the frontend) -------------------------
    def adopt(self, frontend_address: str, secret: WorkerSecret) -> None:
        """Called from any thread: join the frontend at `frontend_address` with `secret`
        (the engine thread does it at its next turn). Requests of the previous frontend
        end (their clients were its connections), the cached prefixes stay and are told
        to the new frontend (KVSnapshot) right after WorkerReady; the weights stay loaded."""
        self.member.adopt(frontend_address, secret)

    def _take_adoption(self) -> None:
        adoption = self.member.take_adoption()
        if adoption is None:
            if self.member.gone:  # outlive_frontend: its requests have no client left
                self._abort_all()
            return
        address, secret = adoption
        logger.warning("adopted by the frontend at %s; ending %d requests of the previous one",
                       address, len(self._request_ids()))
        self._abort_all()
        self._rejoin(replace(self.spec, frontend_address=address), secret)

    def _switch_role(self, msg: P.SwitchRole) -> None:
        """Becomes `msg.role` under a new identity; the engine (weights, cache) stays."""
        if self._request_ids():
            logger.error("SwitchRole while holding %d requests; ending them",
                         len(self._request_ids()))
            self._abort_all()
        spec = replace(self.spec, role=msg.role, index=msg.index, epoch=msg.epoch)
        if spec.role.can_decode and self.receiver is None:
            self.receiver = KVReceiver(self.engine, get_transport(spec.kv_transport).listen(
                f"tcp://{spec.kv_host}:0" if spec.kv_transport == "tcp" else None))
        elif not spec.role.can_decode and self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        logger.warning("switching from %s to %s", self.spec.worker_id, spec.worker_id)
        self._rejoin(spec, WorkerSecret.from_bytes(msg.secret))

    def _rejoin(self, spec: WorkerSpec, secret: WorkerSecret) -> None:
        """Connects anew (another frontend, or another identity) and registers again, with
        a snapshot of the cached prefixes so the router's index starts warm."""
        self.spec = spec
        self.member.rejoin(spec, secret)
        self.engine.take_kv_events()  # the snapshot below says it all
        self._register()
        self._send(self.reports.snapshot(self.engine))
        for batch in self.store.snapshot() if self.store is not None else ():
            self._send(batch)
        self.reports.next_report = 0.0

    def _request_ids(self) -> set[str]:
        return set(self.engine.request_ids()) | set(self.streams) | set(self.reserving)

    def _abort_all(self) -> None:
        for rid in self._request_ids():
            self._abort(rid)

    def _step(self) -> list[RequestOutput]:
        """One engine step; a step that raises fails its requests, not this process (each
        client gets a typed error, or a retry elsewhere: worker_error is retryable)."""
        if not self.engine.has_unfinished:
            return []
        try:
            return self.engine.step()
        except StepFailed as exc:
            for rid in exc.request_ids:
                self._abort(rid)
                self._fail(rid, FailureKind.WORKER_ERROR,
                           f"{self.spec.worker_id} failed computing this request: {exc}")
            return []

    def _wait_s(self) -> float:
        """How long the loop may sleep. Transfers in flight do not shorten it: their
        threads wake it (`_wake_fds`) when there is KV to place, commit or release."""
        if self.engine.has_unfinished:
            return self._pause_s()
        return BUSY_WAIT_S if self.reserving else IDLE_WAIT_S

    def _pause_s(self) -> float:
        """A pacing decode worker's wait before its next step (lending.py)."""
        if self.lending is None or self.lending.pace_s is None:
            return 0.0
        return self.lending.pause_s(self.engine.decode_only)

    def _wake_fds(self) -> list[int]:
        fds = [self.sender.wakeup.fileno()]
        if self.receiver is not None:
            fds.append(self.receiver.wakeup.fileno())
        return fds

    def _receive(self, timeout_s: float) -> None:
        """Acts on every pending message (frames that are not one are dropped by
        FrontendSocket.receive); nothing a message raises ends the engine thread."""
        for msg in self.member.receive(timeout_s, self._wake_fds()):
            try:
                self._handle(msg)
            except Exception:  # _handle fails the request itself: this is the last guard
                logger.exception("handling %s failed", type(msg).__name__)
            if isinstance(msg, P.SwitchRole):
                return  # the rest came over the old identity's link

    def _handle(self, msg: P.Message) -> None:
        """Acts on one message. Whatever a message about one request raises fails that
        request (typed error to the frontend) and nothing else."""
        try:
            self._act(msg)
        except Exception as exc:
            rid = getattr(msg, "request_id", None)
            logger.exception("%s failed", type(msg).__name__)
            if not isinstance(rid, str):
                return
            self._abort(rid)
            self._fail(rid, FailureKind.of(exc), f"{self.spec.worker_id} failed "
                       f"{type(msg).__name__}: {type(exc).__name__}: {exc}")

    def _act(self, msg: P.Message) -> None:
        if isinstance(msg, (P.Generate, P.Prefill, P.ExportPrefix)):
            self.reports.request_received(msg.request_id)
        if isinstance(msg, P.Generate):
            self._generate(msg)
        elif isinstance(msg, P.Prefill):
            self._prefill(msg)
        elif isinstance(msg, P.ExportPrefix):
            self._export_prefix(msg)
        elif isinstance(msg, P.CancelImport):
            self._cancel_import(msg.request_id)
        elif isinstance(msg, P.KVPlan):
            self._kv_plan(msg)
        elif isinstance(msg, P.Migrate):
            self._migrate(msg)
        elif isinstance(msg, P.Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, P.ResyncKV):
            self._send(self.reports.snapshot(self.engine))
        elif isinstance(msg, P.EvictBlocks):
            self.engine.evict_cached_blocks(msg.block_hashes)
        elif isinstance(msg, P.SwitchRole):
            self._switch_role(msg)
        elif isinstance(msg, P.Shutdown):
            self.stopping = True
        elif isinstance(msg, P.InjectFault):
            self.faults.arm(msg.spec)
            logger.warning("fault armed: %s", msg.spec)
        elif isinstance(msg, P.CheckPool):
            self._check_pool(msg.round)
        elif isinstance(msg, P.PurgeTenant):
            self._purge(msg)

    def _purge(self, msg: P.PurgeTenant) -> None:
        """The tenant's blocks leave every tier, the pool's free ones zeroed first."""
        num = self.engine.purge_tenant(msg.tenant)
        removed = [P.TierCount("device", num, num * self.engine.tier_block_bytes)]
        below, error = self.store.purge(msg.tenant) if self.store else ([], None)
        self._send(P.TenantPurged(msg.round, removed + below, error))

    def _check_pool(self, round_: int) -> None:
        error = None
        try:
            self.engine.check_invariants()
        except AssertionError as exc:
            error = f"AssertionError: {exc}"
        self._send(P.PoolReport(round_, error is None, error, self.engine.load().kv_blocks_used,
                                len(self.engine.request_ids())))

    # -- fault injection (worker/faults.py; off unless the spec enables it) ---------------------
    def _inject(self, fault: FaultSpec | None, rid: str | None = None) -> bool:
        """Acts out a fired fault; True when the request `rid` must not go on here."""
        if fault is None:
            return False
        self._flush_outputs()  # what was made before the fault was sent before it
        logger.warning("injected fault fires: %s at %s (request %s)", fault.kind, fault.point, rid)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "stall":
            time.sleep(fault.seconds)
        elif fault.kind == "forget_cache":
            self._publish_events()
            self.engine.evict_cached_blocks(self.engine.cached_block_hashes())
            self.engine.take_kv_events()  # lost: the frontend's index is now stale
        elif fault.kind == "raise":
            raise RuntimeError(f"fault injection: {self.spec.worker_id} raised")
        elif fault.kind == "error" and rid is not None:
            self._fail(rid, FailureKind.WORKER_ERROR, f"fault injection: {self.spec.worker_id} "
                       "failed the request")
            return True
        elif fault.kind.endswith("_kv") and rid is not None:
            self.sender.arm_fault(rid, WireFault(WireFaultKind(fault.kind), fault.seconds))
        return False

    # -- events and reports (reports.py) ---------------------------------------------------
    def _publish_events(self) -> None:
        batch = self.reports.events(self.engine, lambda: self.faults.fire("events") is not None)
        if batch is not None:
            self._send(batch)
        for tier_batch in self.store.event_batches() if self.store is not None else ():
            self._send(tier_batch)

    def _send(self, msg: P.Message) -> None:
        self._flush_outputs()  # one socket, in order: the outputs made before go first
        self._send_now(msg)

    def _flush_outputs(self) -> None:
        while self.outbox:
            batch, self.outbox = (self.outbox[:P.MAX_OUTPUT_BATCH],
                                  self.outbox[P.MAX_OUTPUT_BATCH:])
            self._send_now(batch[0] if len(batch) == 1 else P.OutputBatch(batch))

    def _send_now(self, msg: P.Message) -> None:
        # The frontend gone (a send timed out): drop the rest and exit, or
        # (outlive_frontend) end its requests next turn and wait for a new one's adopt().
        if not self.member.send(msg) and not self.spec.outlive_frontend:
            self.stopping = True

    def close(self) -> None:
        self._abort_all()
        if self.lending is not None:
            self.lending.close()
        self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.store is not None:
            self.store.close()
        self.engine.check_invariants()
        assert self.engine.load().kv_blocks_used == 0, "blocks leaked at shutdown"
        self.member.close()
