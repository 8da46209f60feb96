"""A worker process: one engine, driven by messages from the frontend.

    python -m splitserve.cluster.worker '<WorkerSpec as JSON>'

The main thread is the engine thread. Each turn of its loop: take every pending message
(waiting only when there is nothing to compute), run one engine step, move KV (sender
and receiver polls), send outputs, KV events and, periodically, a load report that is
also the heartbeat. Roles: `prefill` prefills and streams KV out, `decode` imports KV and
decodes, `both` (aggregated) does everything locally; every role can prefill locally,
and every role can hand a decoding request over with its KV (Migrate: live migration).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import replace
from typing import Any

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import WorkerSecret
from splitserve.cluster.protocol import FailureKind, FaultSpec, Role
from splitserve.cluster.worker.membership import Membership
from splitserve.cluster.worker.reports import Reports
from splitserve.cluster.worker.faults import FaultInjector
from splitserve.cluster.worker.handoff import Handoffs
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.cluster.worker.stream import OutputStream
from splitserve.cluster.worker.tiers import WorkerStore
from splitserve.config import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.errors import InvalidRequestError, KVImportError, SplitserveError, StepFailed
from splitserve.transfer.faulty import WireFault, WireFaultKind
from splitserve.transfer.handle import TransferHandle
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender
from splitserve.transfer.transport import TransferState, get_transport

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # longest sleep with nothing to do (deadlines are checked this often)
BUSY_WAIT_S = 0.002  # sleep while only transfers are in flight


class Worker:
    def __init__(self, spec: WorkerSpec, secret: WorkerSecret) -> None:
        self.spec = spec
        self.engine = LLMEngine(EngineConfig.from_kwargs(**spec.engine_args))
        self.engine.enable_kv_events()  # this worker publishes them (_publish_events)
        self.store = WorkerStore.build(self.engine, spec.store, secret.store_key)
        # Every role sends KV: prefill workers their prefills, decode workers the running
        # sequences they hand over (live migration, Migrate).
        self.sender = KVSender(self.engine)
        self.handoffs = Handoffs(self.engine, self.sender)
        self.receiver = (KVReceiver(self.engine, get_transport(spec.kv_transport).listen(
            f"tcp://{spec.kv_host}:0" if spec.kv_transport == "tcp" else None))
            if spec.role.can_decode else None)
        # A CURVE client keyed by `secret` (cluster/auth.py); sends time out when the
        # frontend is gone (then this worker exits, or waits to be adopted: `_send`).
        self.member = Membership(spec, secret)
        self.streams: dict[str, OutputStream] = {}
        self.reserving: dict[str, tuple[P.Generate, float]] = {}  # awaiting block room
        self.reports = Reports(spec.report_interval_s)
        self.stopping = False
        self.faults = FaultInjector(spec.fault_injection)

    # -- loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        self._register()
        parent = os.getppid()
        while not self.stopping:
            self._take_adoption()
            self._receive(self._wait_s())
            self._inject(self.faults.fire("now"))
            outputs = self._step()
            if outputs:
                self.reports.step_done(engine)
                if self.store is not None:
                    self.store.observe_step(engine.last_step)
            self._move_kv(outputs)
            for out in outputs:
                self._output(out)
            self._publish_events()
            if self.reports.is_due():
                self._send(self.reports.load_report(
                    engine, self.receiver, self.store.usage() if self.store else []))
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
            * engine.kv_cache.element_size()))

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
        if self.engine.has_unfinished:
            return 0.0
        busy = self.reserving or self.handoffs or self.sender.num_active or (
            self.receiver and self.receiver.num_active)
        return BUSY_WAIT_S if busy else IDLE_WAIT_S

    def _receive(self, timeout_s: float) -> None:
        """Acts on every pending message (frames that are not one are dropped by
        FrontendSocket.receive); nothing a message raises ends the engine thread."""
        for msg in self.member.receive(timeout_s):
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

    # -- requests -------------------------------------------------------------------------------
    def _generate(self, msg: P.Generate) -> None:
        rid, resumed = msg.request_id, msg.resume_token_ids
        if self._inject(self.faults.fire("generate"), rid):
            return
        if not self._add(rid, msg.prompt_token_ids, msg.params, msg.namespace,
                         await_kv=msg.await_kv, resume_token_ids=resumed, tenant=msg.tenant,
                         kv_prefix_end=msg.kv_prefix_end):
            return
        self.streams[rid] = OutputStream()
        if msg.await_kv:
            self.reserving[rid] = (msg, time.monotonic() + msg.kv_timeout_s)
            self._reserve()

    def _prefill(self, msg: P.Prefill) -> None:
        rid, params, resumed = msg.request_id, msg.params, msg.resume_token_ids
        if self.spec.role is Role.DECODE:
            self._fail(rid, FailureKind.INVALID_REQUEST, f"{self.spec.worker_id} does not "
                       "prefill for others")
            return
        if self._inject(self.faults.fire("prefill"), rid):
            return
        # One token more than the resumed ones: the decode worker samples the rest.
        n = len(resumed) + 1
        first = replace(params, max_tokens=n, min_tokens=min(params.min_tokens, n))
        hand_off = params.max_tokens != n  # else the request ends here: nothing to send
        if not self._add(rid, msg.prompt_token_ids, first, msg.namespace, hold_kv=hand_off,
                         resume_token_ids=resumed, tenant=msg.tenant):
            return
        self.streams[rid] = OutputStream(first_token_only=hand_off, stops=params.stop)
        if hand_off:
            self.handoffs.add(rid, msg.namespace, msg.kv_timeout_s)
            self._inject(self.faults.fire("transfer"), rid)

    def _export_prefix(self, msg: P.ExportPrefix) -> None:
        rid, prefix = msg.request_id, msg.prompt_token_ids
        held = self.handoffs.hold_prefix(rid, prefix, msg.namespace, msg.tenant,
                                         msg.kv_timeout_s)
        if held < len(prefix):
            self._fail(rid, FailureKind.KV_TRANSFER, f"{self.spec.worker_id} holds {held} of "
                       f"the prefix's {len(prefix)} tokens (evicted since it was routed)")

    def _cancel_import(self, rid: str) -> None:
        """The prefix's holder failed: prefill the whole prompt here, now."""
        if self.reserving.pop(rid, None) is not None:
            self.engine.fail_kv(rid, recompute=True)
        elif self.receiver is not None:
            self.receiver.cancel(rid)  # the next poll frees its blocks; it recomputes

    def _migrate(self, msg: P.Migrate) -> None:
        """Stops decoding the request and holds its KV for the plan of the worker it moves
        to; everything it streamed so far was sent before Detached (one socket, in order)."""
        rid = msg.request_id
        try:
            last = self.engine.detach(rid)
        except KVImportError as exc:
            self._send(P.Detached(rid, False, str(exc)))
            return
        self.streams.pop(rid, None)
        self.handoffs.add(rid, msg.namespace, msg.kv_timeout_s)
        self.handoffs.on_prefilled(rid, last)
        self._send(P.Detached(rid, True, None))

    def _kv_plan(self, msg: P.KVPlan) -> None:
        rid = msg.request_id
        try:
            self.handoffs.on_plan(rid, msg.plan)
        except (SplitserveError, ValueError) as exc:
            self._abort(rid)
            self._fail(rid, FailureKind.of(exc), str(exc))

    def _add(self, rid: str, prompt: list[int], params: object, namespace: str | None,
             **kwargs: Any) -> bool:
        try:
            req = self.engine.add_request(rid, prompt, params, namespace=namespace,  # type: ignore[arg-type]
                                          **kwargs)
        except InvalidRequestError as exc:
            self._fail(rid, FailureKind.INVALID_REQUEST, str(exc), exc.field)
            return False
        self.reports.num_prompt_tokens += req.num_prompt_tokens
        if self.store is not None:
            self.store.prefetch(req)
        return True

    def _reserve(self) -> None:
        assert self.receiver is not None
        now = time.monotonic()
        for rid, (msg, deadline) in list(self.reserving.items()):
            plan = self.receiver.expect(rid, namespace=msg.namespace,
                                        timeout_s=max(0.1, deadline - now),
                                        recompute_on_failure=msg.recompute_on_failure)
            if plan is not None:
                del self.reserving[rid]
                self._send(P.KVPlanReady(rid, plan))
            elif now >= deadline:
                del self.reserving[rid]
                self.engine.fail_kv(rid, recompute=msg.recompute_on_failure)
                if not msg.recompute_on_failure:
                    self._drop(rid, FailureKind.KV_TRANSFER,
                               f"no KV blocks free for {msg.kv_timeout_s:g} s")

    def _abort(self, rid: str) -> None:
        self.reserving.pop(rid, None)
        self.handoffs.drop(rid)
        if self.receiver is not None:
            self.receiver.cancel(rid)
        self.sender.cancel(rid)
        self.engine.abort(rid)
        self.engine.release_kv(rid)
        self.streams.pop(rid, None)

    def _drop(self, rid: str, kind: FailureKind, message: str) -> None:
        self.streams.pop(rid, None)
        self._fail(rid, kind, message)

    def _fail(self, rid: str, kind: FailureKind, message: str,
              field: str | None = None) -> None:
        self._send(P.RequestFailed(rid, kind, message, field))

    # -- KV movement ----------------------------------------------------------------------------
    def _move_kv(self, outputs: list[RequestOutput]) -> None:
        if self.reserving:
            self._reserve()
        for handle in self.sender.poll(outputs):
            self._report_transfer(handle)
            self._send(P.PrefillDone(handle.request_id, self.handoffs.finished(handle)))
        for rid in self.handoffs.expire(time.monotonic()):
            self.streams.pop(rid, None)
            self._send(P.PrefillDone(rid, handed_off=False))
        if self.receiver is not None:
            for handle in self.receiver.poll():
                self._report_transfer(handle)
                status = handle.poll()
                if status.state is TransferState.DONE and handle.output is not None:
                    # Token 1 reached the client from the prefill worker: streaming goes
                    # on from token 2 (with any of token 1's text it held back).
                    self._send_output(handle.output, send=handle.output.finished)
                elif status.state is TransferState.FAILED and self.engine.request_state(
                        handle.request_id) is None:  # not recomputing locally
                    self._drop(handle.request_id, FailureKind.KV_TRANSFER, str(status.error))

    def _report_transfer(self, handle: TransferHandle) -> None:
        self._send(P.TransferReport(handle.telemetry))

    # -- outputs --------------------------------------------------------------------------------
    def _output(self, out: RequestOutput) -> None:
        try:
            self._send_output(out)
        except Exception as exc:
            logger.exception("streaming %s failed", out.request_id)
            self._abort(out.request_id)
            self._fail(out.request_id, FailureKind.WORKER_ERROR, f"{self.spec.worker_id} "
                       f"failed streaming this request: {type(exc).__name__}: {exc}")

    def _send_output(self, out: RequestOutput, send: bool = True) -> None:
        """Streams an engine output to the frontend (`send=False`: only counts it)."""
        rid, stream = out.request_id, self.streams.get(out.request_id)
        if stream is None:
            return
        stream.count(out)
        if not send:
            return
        if stream.hands_off(out):
            self.handoffs.on_prefilled(rid, out.token_ids[-1])  # the KV is held for D
        elif stream.first_token_only and out.finished:  # a stop at token 1: no handoff
            if self.handoffs.end_early(rid):
                self.engine.release_kv(rid)
        self._send(stream.next_output(out))
        if out.finished:
            self.streams.pop(rid, None)
            self.reports.num_hit_tokens += out.num_cached_tokens
        if out.delta_token_ids:
            self._inject(self.faults.fire("first_token" if stream.first_token_only
                                          else "decode"), rid)

    # -- events and reports (reports.py) ---------------------------------------------------
    def _publish_events(self) -> None:
        batch = self.reports.events(self.engine, lambda: self.faults.fire("events") is not None)
        if batch is not None:
            self._send(batch)
        for tier_batch in self.store.event_batches() if self.store is not None else ():
            self._send(tier_batch)

    def _send(self, msg: P.Message) -> None:
        # The frontend gone (a send timed out): drop the rest and exit, or
        # (outlive_frontend) end its requests next turn and wait for a new one's adopt().
        if not self.member.send(msg) and not self.spec.outlive_frontend:
            self.stopping = True

    def close(self) -> None:
        self._abort_all()
        self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.store is not None:
            self.store.close()
        self.engine.check_invariants()
        assert self.engine.load().kv_blocks_used == 0, "blocks leaked at shutdown"
        self.member.close()
