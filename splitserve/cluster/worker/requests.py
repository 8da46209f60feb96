"""A worker's requests: the messages that start, move and end them (Generate, Prefill,
ExportPrefix, KVPlan, Migrate, CancelImport, Abort), the KV they move each turn (sender,
receiver, block reservations of requests awaiting KV), and their outputs to the frontend.
Mixed into Worker (worker.py), which owns the loop, the links and the lifecycle."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from splitserve.cluster import protocol as P
from splitserve.cluster.protocol import FailureKind, FaultSpec, Role
from splitserve.cluster.worker.handoff import Handoffs
from splitserve.cluster.worker.reports import Reports
from splitserve.cluster.worker.faults import FaultInjector
from splitserve.cluster.worker.spec import WorkerSpec
from splitserve.cluster.worker.stream import OutputStream
from splitserve.cluster.worker.tiers import WorkerStore
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.errors import InvalidRequestError, KVImportError, SplitserveError
from splitserve.transfer.handle import TransferHandle
from splitserve.transfer.receiver import KVReceiver
from splitserve.transfer.sender import KVSender
from splitserve.transfer.transport import TransferState

logger = logging.getLogger(__name__)


class RequestHandling:
    """Worker's request methods; Worker's constructor sets what is declared here."""
    spec: WorkerSpec
    engine: LLMEngine
    store: WorkerStore | None
    sender: KVSender
    handoffs: Handoffs
    receiver: KVReceiver | None  # decode-capable roles only
    streams: dict[str, OutputStream]
    outbox: list[P.Output]  # made this turn, not yet sent (Worker._flush_outputs)
    reserving: dict[str, tuple[P.Generate, float]]  # awaiting block room, until a deadline
    reports: Reports
    faults: FaultInjector

    def _send(self, msg: P.Message) -> None:
        raise NotImplementedError  # Worker's: to the frontend

    def _inject(self, fault: FaultSpec | None, rid: str | None = None) -> bool:
        raise NotImplementedError  # Worker's: acts out a fired fault

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
            req = self.engine.add_request(rid, prompt, params,  # type: ignore[arg-type]
                                          namespace=namespace, **kwargs)
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
        """Streams an engine output to the frontend (`send=False`: only counts it): queued
        in the outbox, which goes out before any other message and at the end of the turn."""
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
        self.outbox.append(stream.next_output(out))
        if out.finished:
            self.streams.pop(rid, None)
            self.reports.num_hit_tokens += out.num_cached_tokens
        if out.delta_token_ids:
            self._inject(self.faults.fire("first_token" if stream.first_token_only
                                          else "decode"), rid)
