"""The decode side of a KV transfer: reserve blocks, authenticate and validate every frame
as it lands, place verified layers, and commit only when the whole range is verified.

    engine thread                  gate thread (gate.py)      reader thread (per transfer)
    expect(rid) -> plan (blocks
      reserved, a fresh key)
                                   whole HEADER frame -> its transfer's key, its tag
                                   (unknown, forged: closed;
                                    the import is untouched)
                                                              header: fingerprint, request,
                                                                namespace, range, block
                                                                hashes, layout -> ACCEPTED
                                                                (or REJECTED, rest dropped)
                                                              layer i: length, tag -> queue
    poll(): write_kv_layer(verified)                          trailer: tag, first token
    poll(): all placed + trailer -> commit_kv                 -> reply COMMITTED
    poll(): error or deadline -> fail_kv                      -> reply REJECTED (nothing
                                                                 committed)

Placed layers go into the request's reserved blocks, which nothing reads before
`commit_kv` (the request is WAITING_FOR_KV and its blocks are not in the prefix cache), so
a failure at any point leaves no trace: `fail_kv` returns them to the pool. Transfer ids
(and keys) are remembered after they finish, so a duplicate delivery is answered and
ignored. A header that fails its tag (someone without the plan's key, or corruption)
closes its connection without claiming the import, so it cannot block the real sender.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from splitserve.engine.kv_connector import KVConnector, KVRange
from splitserve.errors import (ChecksumMismatch, HeaderMismatch, KVImportError,
                               KVTransferError, TransferCancelled, TransferTimeout,
                               WorkerFailed)
from splitserve.transfer.blob import (PRELUDE, BlobHeader, BlobReader, BlobTrailer, FrameKind,
                                      Prelude, ReplyOutcome, TransferReply, parse_header,
                                      record_frame)
from splitserve.transfer.gate import GateLimits, GateStats, HeaderGate
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.layer_codec import Compression, layer_nbytes
from splitserve.transfer.mac import FrameMac, new_key
from splitserve.transfer.packing import check_fits
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry
from splitserve.transfer.transport import Channel, Listener, TransferState, scheme
from splitserve.transfer.wakeup import Wakeup

logger = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 5.0  # for sending a reply; the sender is waiting for it
# A refusal sent from the gate thread must not wait on the peer: it goes out if the socket
# takes it at once (a reply is ~100 bytes), else the connection is just closed.
REFUSE_TIMEOUT_S = 0.05
MAX_DRAINS = 16  # refused-but-authenticated transfers read and dropped at once (threads)


class _Import:
    """One expected transfer: its plan, reserved blocks and verified-but-unplaced layers."""

    def __init__(self, plan: TransferPlan, target: KVRange, recompute: bool,
                 telemetry: TransferTelemetry) -> None:
        self.plan, self.target, self.recompute = plan, target, recompute
        self.handle = TransferHandle(plan.transfer_id, plan.request_id, telemetry)
        self.deadline = time.monotonic() + plan.timeout_s
        self.verified: deque[tuple[int, torch.Tensor]] = deque()  # (layer, kv) to place
        self.num_placed = 0
        self.trailer: BlobTrailer | None = None
        self.error: KVTransferError | None = None  # first error wins; poll() fails it
        self.channel: Channel | None = None  # the channel that claimed this transfer
        self.settled = threading.Event()  # committed or failed: the reader may reply

    def fail(self, error: KVTransferError, close: bool) -> None:
        if self.error is None:
            self.error = error
        if close and self.channel is not None:
            self.channel.close()  # wakes the reader thread


class KVReceiver:
    """Receives prompt KV into `engine` (a decode engine) through `listener`.

    Usage on the engine thread:

        engine.add_request(rid, prompt, params, namespace=ns, await_kv=True)
        plan = receiver.expect(rid, namespace=ns)   # None: no free blocks yet, retry later
        ... send plan to the prefill worker; then every step / when idle:
        for handle in receiver.poll(): handle.poll() is Done (handle.output: first token
                                       output) or Failed(reason) (blocks already freed)
    """

    def __init__(self, engine: KVConnector, listener: Listener, *, header_timeout_s: float = 10.0,
                 remember: int = 4096, limits: GateLimits | None = None) -> None:
        self.engine, self.listener = engine, listener
        limits = limits or GateLimits(header_timeout_s=header_timeout_s)
        self.header_timeout_s = limits.header_timeout_s
        self._remember = remember
        self._imports: dict[str, _Import] = {}  # transfer id -> active import
        # Verdicts and keys of finished transfers, by id (small: dedup must not pin outputs;
        # the key authenticates a repeat delivery before it is answered and drained).
        self._recent: OrderedDict[str, tuple[TransferReply, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.wakeup = Wakeup()  # set by readers when poll() has work
        self._busy: set[Channel] = set()  # channels being read by a thread of ours
        self._num_drains = 0
        self.num_forged = 0  # headers that failed authentication
        self.num_rejected_headers = 0  # headers refused: bad, unknown transfer, forged, ...
        self._gate = HeaderGate(listener, self._on_header, limits)
        self._gate.start()

    @property
    def address(self) -> str:
        return self.listener.address

    # -- engine thread ------------------------------------------------------------------------
    def expect(self, request_id: str, *, namespace: str | None = None, timeout_s: float = 30.0,
               recompute_on_failure: bool = False) -> TransferPlan | None:
        """Reserves blocks for a request added with `await_kv=True` and returns the plan to
        give its sender; None when the pool has no room yet (call again later). On failure
        or deadline the blocks are released and the request is prefilled locally
        (`recompute_on_failure`) or dropped."""
        if any(imp.plan.request_id == request_id for imp in self._imports.values()):
            raise ValueError(f"request {request_id!r} already expects a transfer")
        target = self.engine.kv_import_target(request_id)
        if target is None:
            return None
        plan = TransferPlan(uuid.uuid4().hex, request_id, namespace, self.address,
                            target.start_token, target.end_token, timeout_s, key=new_key())
        telemetry = TransferTelemetry(plan.transfer_id, request_id, scheme(plan.address),
                                      TransferSide.RECEIVER,
                                      num_tokens=target.end_token - target.start_token)
        with self._lock:
            self._imports[plan.transfer_id] = _Import(plan, target, recompute_on_failure,
                                                      telemetry)
        return plan

    def wait(self, timeout_s: float) -> bool:
        """Blocks until a transfer has work for `poll` (a verified layer, a trailer, an
        error) or `timeout_s` passed; lets an idle engine thread sleep instead of spinning.
        Deadlines are only noticed by `poll`, so keep `timeout_s` short (e.g. 50 ms)."""
        return self.wakeup.wait(timeout_s)

    def poll(self) -> list[TransferHandle]:
        """Places verified layers, commits complete imports, fails broken or late ones
        (releasing their blocks). Returns the handles that finished since the last call.
        WorkerFailed if the listener stopped (gate.py): this receiver gets no more KV."""
        if self._gate.failure is not None:
            raise WorkerFailed(f"the KV listener at {self.address} stopped "
                               f"({self._gate.failure!r}); no KV can reach this worker")
        return self._poll()

    @property
    def stats(self) -> GateStats:
        """The listener's connection counts (held, busy, evicted, ...)."""
        return self._gate.stats

    def _poll(self) -> list[TransferHandle]:
        self.wakeup.clear()  # before looking: later reader events set it again
        now = time.monotonic()
        finished = []
        for imp in list(self._imports.values()):
            if imp.error is None and now >= imp.deadline:
                imp.fail(TransferTimeout(f"KV of request {imp.plan.request_id!r} did not "
                                         f"arrive within {imp.plan.timeout_s:g} s"), close=True)
            if imp.error is None:
                try:
                    self._place(imp)
                except KVImportError as exc:  # the request left the engine meanwhile
                    imp.fail(TransferCancelled(str(exc)), close=True)
            if imp.error is not None:
                self.engine.fail_kv(imp.plan.request_id, imp.recompute)
                imp.handle.finish(imp.error)
            if imp.handle.poll().is_terminal:
                self._retire(imp)
                finished.append(imp.handle)
        return finished

    def cancel(self, request_id: str) -> None:
        """Abandons the request's import; the next `poll` releases its blocks."""
        for imp in list(self._imports.values()):
            if imp.plan.request_id == request_id:
                imp.fail(TransferCancelled(f"import of {request_id!r} was cancelled"), close=True)

    def close(self) -> None:
        """Stops listening, fails every open import (releasing blocks) and stops threads."""
        self._closed.set()
        self._gate.close()  # stops accepting; closes the idle channels it holds
        for imp in list(self._imports.values()):
            imp.fail(TransferCancelled("the KV receiver was closed"), close=True)
        with self._lock:
            channels = list(self._busy)
        for channel in channels:
            channel.close()  # wakes their readers
        self._poll()
        self.wakeup.close()

    def _place(self, imp: _Import) -> None:
        t0 = time.perf_counter()
        while imp.verified:
            layer, kv = imp.verified.popleft()
            self.engine.write_kv_layer(layer, imp.target.block_ids, kv)
            imp.num_placed += 1
        trailer = imp.trailer
        if trailer is not None and imp.num_placed == trailer.num_layers:
            imp.handle.output = self.engine.commit_kv(imp.plan.request_id, trailer.first_token_id)
            imp.handle.finish()
        imp.handle.telemetry.place_s += time.perf_counter() - t0

    def _retire(self, imp: _Import) -> None:
        with self._lock:
            self._imports.pop(imp.plan.transfer_id, None)
            self._recent[imp.plan.transfer_id] = (
                self._verdict(imp.handle, ReplyOutcome.DUPLICATE), imp.plan.key)
            while len(self._recent) > self._remember:
                self._recent.popitem(last=False)
        imp.settled.set()

    # -- network side ---------------------------------------------------------------------------
    def _on_header(self, channel: Channel, prelude: Prelude, body: bytes) -> None:
        """Gate thread, so it never blocks: a whole HEADER frame arrived on `channel`.
        Authenticated under its transfer's key, it gets a thread (to receive the transfer,
        or to answer a repeat and drain it); anything else is refused and closed."""
        try:
            header = parse_header(body)
        except KVTransferError as exc:
            return self._refuse(channel, "", exc)
        tid = header.transfer_id
        with self._lock:
            imp, done = self._imports.get(tid), self._recent.get(tid)
        key = imp.plan.key if imp is not None else done[1] if done is not None else None
        if key is None:
            return self._refuse(channel, tid, HeaderMismatch(
                f"no import is expected for transfer {tid} (unknown, or its deadline passed "
                "long ago)"))
        mac = FrameMac(key, tid)
        if not mac.verify(FrameKind.HEADER, 0, body, prelude.tag):
            self.num_forged += 1
            if self.num_forged & (self.num_forged - 1) == 0:  # 1, 2, 4, ...: no log flood
                logger.warning("a KV header for transfer %s failed authentication (no key, "
                               "or corrupted; %d so far); connection closed, import "
                               "untouched", tid, self.num_forged)
            return self._refuse(channel, tid, ChecksumMismatch(
                f"header of transfer {tid} fails its authentication tag"))
        reader = BlobReader(channel, mac)
        reader.num_bytes = PRELUDE.size + len(body)  # the header, read by the gate
        with self._lock:
            claimed = (imp is not None and self._imports.get(tid) is imp
                       and imp.channel is None and imp.error is None)
            drains = self._num_drains
            if claimed and imp is not None:
                imp.channel = channel
            elif drains < MAX_DRAINS:
                self._num_drains += 1
            if claimed or drains < MAX_DRAINS:
                self._busy.add(channel)
        if claimed and imp is not None:
            self._spawn(self._serve, channel, reader, imp, header)
        elif drains >= MAX_DRAINS:
            self._refuse(channel, tid, KVTransferError("too many refused transfers are being "
                                                       "drained; retry later"))
        elif imp is not None:  # a second delivery while the first is in flight
            self._spawn(self._answer_and_drain, channel, reader, header, TransferReply(
                tid, ReplyOutcome.REJECTED, "DuplicateTransfer",
                "this transfer is already being received; duplicate ignored"))
        else:  # finished: DUPLICATE if it was committed, else REJECTED
            assert done is not None
            self._spawn(self._answer_and_drain, channel, reader, header, done[0])

    def _spawn(self, target: Callable[..., None], channel: Channel, *args: object) -> None:
        threading.Thread(target=target, args=(channel, *args), daemon=True,
                         name="kv-recv").start()

    def _serve(self, channel: Channel, reader: BlobReader, imp: _Import,
               header: BlobHeader) -> None:
        keep = False
        try:
            keep = self._receive(channel, reader, imp, header)
        finally:
            with self._lock:
                self._busy.discard(channel)
            self._gate.finished(channel, keep and not self._closed.is_set())

    def _answer_and_drain(self, channel: Channel, reader: BlobReader, header: BlobHeader,
                          reply: TransferReply) -> None:
        keep = False
        try:
            self._send_reply(channel, reply, reader.mac)
            keep = self._drain(reader, header)
        finally:
            with self._lock:
                self._busy.discard(channel)
                self._num_drains -= 1
            self._gate.finished(channel, keep and not self._closed.is_set())

    def _refuse(self, channel: Channel, transfer_id: str, error: KVTransferError) -> None:
        """Gate thread: an untagged REJECTED if the socket takes it at once; closed."""
        self.num_rejected_headers += 1
        self._send_reply(channel, TransferReply(transfer_id, ReplyOutcome.REJECTED,
                                                type(error).__name__, str(error)),
                         None, REFUSE_TIMEOUT_S)
        self._gate.finished(channel, keep=False)

    def _receive(self, channel: Channel, reader: BlobReader, imp: _Import,
                 header: BlobHeader) -> bool:
        """Receives the transfer this channel claimed with its authenticated header. True
        when it ended in step with the sender (committed, or refused at its header and
        drained), so that the channel can carry the next one."""
        accepted = False
        try:
            tel = imp.handle.telemetry
            t0 = time.perf_counter()
            check_fits(self.engine.kv_layout, imp.plan, imp.target, header)
            tel.validate_s += time.perf_counter() - t0
            tel.compression, tel.num_layers = header.compression.value, header.num_layers
            tel.payload_bytes = header.num_layers * layer_nbytes(
                header.layer_shape, header.dtype, Compression.NONE)
            imp.handle.mark_transferring()  # before answering: the peer may be quick
            wire_start = time.monotonic()
            channel.send(record_frame(FrameKind.REPLY, TransferReply(
                header.transfer_id, ReplyOutcome.ACCEPTED), reader.mac), imp.deadline)
            accepted = True
            for layer in range(header.num_layers):
                kv = reader.read_layer(header, layer, imp.deadline)
                imp.verified.append((layer, kv))
                self.wakeup.set()
            imp.trailer = reader.read_trailer(header, imp.deadline)
            self.wakeup.set()
            tel.wire_s = time.monotonic() - wire_start
            tel.wire_bytes = reader.num_bytes
            tel.validate_s += reader.mac_s
        except KVTransferError as exc:
            imp.fail(exc, close=False)
        except Exception as exc:  # a bug: fail the import, never hang it
            logger.exception("KV receive failed")
            imp.fail(KVTransferError(f"internal error while receiving: {exc!r}"), close=False)
        else:  # the trailer arrived: wait for the engine thread's verdict
            imp.settled.wait(max(0.0, imp.deadline - time.monotonic()) + 1.0)
            verdict = self._verdict(imp.handle, ReplyOutcome.COMMITTED)
            self._send_reply(channel, verdict, reader.mac)
            return verdict.outcome == ReplyOutcome.COMMITTED
        self.wakeup.set()
        # Failed: reply at once (nothing can commit any more: the error is set).
        assert imp.error is not None
        self._send_reply(channel, TransferReply(imp.plan.transfer_id, ReplyOutcome.REJECTED,
                                                type(imp.error).__name__, str(imp.error)),
                         reader.mac)
        return not accepted and self._drain(reader, header)

    def _drain(self, reader: BlobReader, header: BlobHeader) -> bool:
        """Reads and drops the rest of a transfer refused at its header (its sender streams
        on without waiting for the answer). The answer then reaches the sender (a TCP close
        with unread bytes resets the connection and can discard it) and the channel stays
        in step. A sender that saw the answer stops and closes: then False."""
        try:
            deadline = time.monotonic() + self.header_timeout_s
            for layer in range(header.num_layers):
                reader.skip_layer(header, layer, deadline)
            reader.read_trailer(header, deadline)
            return True
        except KVTransferError:
            return False

    @staticmethod
    def _verdict(handle: TransferHandle, if_done: ReplyOutcome) -> TransferReply:
        """The reply for a settled import: `if_done` (COMMITTED for its own delivery,
        DUPLICATE for a repeat) when it is DONE, else REJECTED with the reason."""
        status, tel = handle.poll(), handle.telemetry
        if status.state == TransferState.DONE:
            return TransferReply(handle.transfer_id, if_done, validate_s=tel.validate_s,
                                 place_s=tel.place_s)
        error = status.error or TransferTimeout("the import was not settled in time")
        return TransferReply(handle.transfer_id, ReplyOutcome.REJECTED, type(error).__name__,
                             str(error))

    @staticmethod
    def _send_reply(channel: Channel, reply: TransferReply, mac: FrameMac | None,
                    timeout_s: float = REPLY_TIMEOUT_S) -> None:
        try:
            channel.send(record_frame(FrameKind.REPLY, reply, mac), time.monotonic() + timeout_s)
        except KVTransferError:
            pass  # the sender is gone or stalled; its own deadline ends its side
