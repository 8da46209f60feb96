"""The prefill side of a KV transfer: stream a request's prompt KV, layer by layer, while
the engine still computes, and hold its blocks under a lease until the receiver answers.

    engine thread (forward pass)            send thread (one per transfer)
    layer i done -> read_kv_layer (copy) --> zero tail, encode, checksum, one write
    step returns -> poll(outputs)        --> trailer(first token), wait for the reply
    poll(): reply or lease expiry        --> release_kv, exactly once

Every engine call (read_kv_layer, export_kv, release_kv) happens on the engine thread:
inside the layer listener or in `start` / `send_held` / `poll` / `cancel`, which the
worker calls between steps. The layer listener only copies the layer's blocks out (so the
bytes sent are a snapshot, whatever the engine does next) and enqueues them.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.batch import ScheduledBatch
from splitserve.engine.engine import LLMEngine
from splitserve.engine.output import RequestOutput
from splitserve.errors import (BlobFormatError, KVImportError, KVTransferError,
                               TransferCancelled, TransferRejected, TransferTimeout,
                               TruncatedTransfer)
from splitserve.kv_cache import root_hash
from splitserve.transfer.blob import (BlobHeader, BlobReader, BlobTrailer, FrameKind,
                                      ReplyOutcome, TransferReply, record_frame)
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.layer_codec import Compression, layer_nbytes
from splitserve.transfer.packing import build_header, pack_layer
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry
from splitserve.transfer.transport import (Buffer, Channel, ChannelPool, TransferState,
                                           remaining, scheme)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _LayerJob:
    layer: int
    kv: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], a private copy
    enqueued: float


@dataclass(slots=True)
class _TrailerJob:
    first_token_id: int


class _Export:
    """One outgoing transfer: its header, job queue, send thread and lease."""

    def __init__(self, plan: TransferPlan, header: BlobHeader, telemetry: TransferTelemetry,
                 deadline: float) -> None:
        self.plan, self.header = plan, header
        self.handle = TransferHandle(plan.transfer_id, plan.request_id, telemetry)
        self.deadline = deadline  # transfer deadline == lease expiry of the held blocks
        self.jobs: queue.SimpleQueue[_LayerJob | _TrailerJob | None] = queue.SimpleQueue()
        self.layers_copied = 0
        self.prefill_done = False  # the first token was seen: the engine holds the blocks
        self.compute_start: float | None = None  # monotonic time of the streaming step's layer 0
        self.compute_end: float | None = None
        self.send_spans: list[tuple[float, float]] = []
        self.channel: Channel | None = None
        self.reader: BlobReader | None = None
        self.in_step = False  # the whole transfer and its answer crossed: channel reusable
        self.released = False
        self.thread: threading.Thread | None = None

    def fail(self, error: KVTransferError) -> None:
        if self.handle.finish(error):
            self.jobs.put(None)  # wakes the send thread if it waits for a job
            if self.channel is not None:
                self.channel.close()  # wakes it if it waits on the network


class KVSender:
    """Sends prompt KV from `engine` (a prefill engine) to receivers named by plans.

    Usage on the engine thread:

        engine.add_request(rid, prompt, replace(params, max_tokens=1),
                           namespace=ns, hold_kv=True)
        handle = sender.start(rid, plan, namespace=ns)   # before the prefill step
        ... outputs = engine.step(); sender.poll(outputs) ...   # every step, and when idle
        handle.poll() -> Pending | Transferring | Done | Failed(reason)
    """

    def __init__(self, engine: LLMEngine, *, compression: Compression = Compression.NONE) -> None:
        self.engine = engine
        self.compression = compression
        self.num_released = 0  # requests whose held KV this sender freed (exactly once each)
        self._exports: dict[str, _Export] = {}
        # Injected wire faults by request id: (kind, seconds), kind drop | corrupt | delay.
        self.wire_faults: dict[str, tuple[str, float]] = {}
        self._streaming: list[tuple[_Export, list[int]]] = []
        self._streaming_batch: ScheduledBatch | None = None
        self._chained = engine.layer_listener
        engine.layer_listener = self._on_layer
        self._channels = ChannelPool()  # open channels to receivers, kept between transfers

    # -- engine thread ------------------------------------------------------------------------
    def start(self, request_id: str, plan: TransferPlan, *, namespace: str | None = None,
              compression: Compression | None = None) -> TransferHandle:
        """Streams the prompt KV of a request added with `hold_kv=True` and not yet
        prefilled: each layer leaves as soon as the prefill step computed it.
        `namespace` is the one the request was added with (checked against the engine)."""
        req = self.engine.scheduler.requests.get(request_id)
        if req is None or not req.hold_kv:
            raise KVImportError(f"request {request_id!r} is not a live request added with "
                                "hold_kv=True; add it before starting its transfer")
        if req.cache_root != root_hash(self.engine.fingerprint, namespace):
            raise ValueError(f"request {request_id!r} was added with another namespace than "
                             f"{namespace!r}; pass the namespace given to add_request")
        if plan.end_token != req.num_prefill_tokens:
            raise ValueError(f"plan covers tokens up to {plan.end_token} but the prompt has "
                             f"{req.num_prefill_tokens}; the two engines got different prompts")
        bs = self.engine.block_size
        hashes = req.block_hashes[plan.start_token // bs:plan.end_token // bs]
        export = self._new_export(request_id, plan, namespace, hashes, compression)
        if req.num_computed_tokens >= req.num_prefill_tokens:
            logger.warning("request %s was prefilled before its transfer started; its KV "
                           "will be sent after the fact", request_id)
        return export.handle

    def send_held(self, request_id: str, plan: TransferPlan, first_token_id: int, *,
                  namespace: str | None = None,
                  compression: Compression | None = None) -> TransferHandle:
        """Sends the KV of a request that already finished with `hold_kv=True` (no overlap
        with compute: every layer is copied out now)."""
        kv = self.engine.export_kv(request_id)
        if plan.end_token != kv.end_token:
            raise ValueError(f"plan covers tokens up to {plan.end_token} but the held prompt "
                             f"has {kv.end_token}")
        skip = plan.start_token // self.engine.block_size
        export = self._new_export(request_id, plan, namespace, kv.block_hashes[skip:],
                                  compression)
        export.prefill_done = True
        self._copy_all_layers(export, kv.block_ids[skip:])
        export.jobs.put(_TrailerJob(first_token_id))
        return export.handle

    def poll(self, outputs: Sequence[RequestOutput] = ()) -> list[TransferHandle]:
        """Call after every step with its outputs (and periodically when idle): ends the
        streams whose prefill finished, releases the KV of transfers that were answered,
        failed or whose lease expired. Returns the handles that finished since last time."""
        now = time.monotonic()
        for out in outputs:
            export = self._exports.get(out.request_id)
            if export is not None and not export.prefill_done:
                self._on_prefill_output(export, out, now)
        finished = []
        for request_id, export in list(self._exports.items()):
            if not export.prefill_done and request_id not in self.engine.scheduler.requests:
                export.prefill_done = True  # it left the engine without an output we saw
                export.fail(TransferCancelled(f"request {request_id!r} ended before its "
                                              "prefill produced a token"))
            status = export.handle.poll()
            if not status.is_terminal and now >= export.deadline:
                export.fail(TransferTimeout(
                    f"lease of request {request_id!r} expired after {export.plan.timeout_s:g} s "
                    "without an answer from the receiver"))
                status = export.handle.poll()
            if export.prefill_done and status.is_terminal:
                self._release(export)
                del self._exports[request_id]
                finished.append(export.handle)
        return finished

    @property
    def num_active(self) -> int:
        """Transfers not yet finished and released."""
        return len(self._exports)

    def cancel(self, request_id: str) -> None:
        """Stops the request's transfer; its KV is released by the next `poll`."""
        export = self._exports.get(request_id)
        if export is not None:
            export.fail(TransferCancelled(f"transfer of request {request_id!r} was cancelled"))

    def close(self) -> None:
        """Cancels every transfer and detaches from the engine (engine thread). Held KV is
        released; a request still prefilling for a transfer is aborted, since nobody
        would release its blocks after it finished."""
        for request_id, export in list(self._exports.items()):
            export.fail(TransferCancelled("the KV sender was closed"))
            if not export.prefill_done:
                self.engine.abort(request_id)
            self._release(export)
            del self._exports[request_id]
            if export.thread is not None:
                export.thread.join(timeout=5)
        if self.engine.layer_listener == self._on_layer:
            self.engine.layer_listener = self._chained
        self._channels.close()

    # -- inside the forward pass (engine thread) --------------------------------------------
    def _on_layer(self, layer: int, batch: ScheduledBatch) -> None:
        if self._chained is not None:
            self._chained(layer, batch)
        if not self._exports:
            return
        if batch is not self._streaming_batch:  # first layer of a new step
            self._streaming_batch = batch
            self._streaming = self._streams_completing_in(batch)
        for export, block_ids in self._streaming:
            if export.layers_copied != layer:
                continue
            t0 = time.perf_counter()
            kv = self.engine.read_kv_layer(layer, block_ids)
            export.handle.telemetry.pack_s += time.perf_counter() - t0
            export.handle.telemetry.layers_during_compute += 1
            export.jobs.put(_LayerJob(layer, kv, time.monotonic()))
            export.layers_copied += 1

    def _streams_completing_in(self, batch: ScheduledBatch) -> list[tuple[_Export, list[int]]]:
        """Exports whose prompt's last token is computed in this step (so every layer's KV
        of the whole range is in the cache once that layer ran), with their block ids."""
        bs = self.engine.block_size
        streams = []
        for seq in batch.seqs:
            export = self._exports.get(seq.request_id)
            if (export is None or export.layers_copied or export.handle.poll().is_terminal
                    or seq.start_pos + len(seq.token_ids) != export.header.end_token):
                continue
            export.compute_start = time.monotonic()
            first = export.header.start_token // bs
            streams.append((export, seq.block_table[first:first + export.header.layer_shape[1]]))
        return streams

    # -- helpers (engine thread) ----------------------------------------------------------
    def _new_export(self, request_id: str, plan: TransferPlan, namespace: str | None,
                    block_hashes: Sequence[bytes], compression: Compression | None) -> _Export:
        if request_id in self._exports:
            raise ValueError(f"request {request_id!r} already has a transfer in progress")
        if plan.request_id != request_id:
            raise ValueError(f"plan is for request {plan.request_id!r}, not {request_id!r}")
        compression = self.compression if compression is None else compression
        header = build_header(self.engine, plan, namespace, block_hashes, compression)
        shape, dtype = header.layer_shape, header.dtype
        telemetry = TransferTelemetry(
            plan.transfer_id, request_id, scheme(plan.address), TransferSide.SENDER,
            compression=compression.value, num_layers=header.num_layers,
            num_tokens=plan.end_token - plan.start_token,
            payload_bytes=layer_nbytes(shape, dtype, Compression.NONE) * header.num_layers)
        export = _Export(plan, header, telemetry, time.monotonic() + plan.timeout_s)
        export.thread = threading.Thread(target=self._run, args=(export,), daemon=True,
                                         name=f"kv-send-{request_id}")
        self._exports[request_id] = export
        export.thread.start()
        return export

    def _on_prefill_output(self, export: _Export, out: RequestOutput, now: float) -> None:
        # Output tokens before the first one sampled here (a resumed request has some).
        num_resumed = export.header.end_token - len(out.prompt_token_ids)
        if len(out.token_ids) <= num_resumed:  # aborted or failed before sampling
            export.prefill_done = True
            export.fail(TransferCancelled(f"request {out.request_id!r} finished "
                                          f"({out.finish_reason}) before its first token"))
            return
        export.prefill_done = True
        export.compute_end = now
        if export.layers_copied < export.header.num_layers:
            # The prefill ran before start() (or without streaming): copy from held blocks.
            try:
                kv = self.engine.export_kv(out.request_id)
            except KVImportError as exc:
                export.fail(TransferCancelled(f"KV of {out.request_id!r} is not held: {exc}"))
                return
            first = export.header.start_token // self.engine.block_size
            self._copy_all_layers(export, kv.block_ids[first:])
        export.jobs.put(_TrailerJob(out.token_ids[num_resumed]))

    def _copy_all_layers(self, export: _Export, block_ids: list[int]) -> None:
        for layer in range(export.layers_copied, export.header.num_layers):
            t0 = time.perf_counter()
            kv = self.engine.read_kv_layer(layer, block_ids)
            export.handle.telemetry.pack_s += time.perf_counter() - t0
            export.jobs.put(_LayerJob(layer, kv, time.monotonic()))
            export.layers_copied += 1

    def _release(self, export: _Export) -> None:
        """Frees the request's held blocks, exactly once (release_kv is idempotent too)."""
        if not export.released:
            export.released = True
            self.engine.release_kv(export.plan.request_id)
            self.num_released += 1

    # -- send thread -------------------------------------------------------------------------
    def _run(self, export: _Export) -> None:
        try:
            with torch.inference_mode():  # layers copied in the forward are inference tensors
                self._stream(export)
        except TruncatedTransfer as exc:
            export.fail(self._explain(export, exc))
        except KVTransferError as exc:
            export.fail(exc)
        except Exception as exc:  # a bug: fail the transfer, never hang it
            logger.exception("KV send of %s failed", export.plan.request_id)
            export.fail(KVTransferError(f"internal error while sending: {exc!r}"))
        finally:
            channel, export.channel = export.channel, None
            if channel is not None and export.in_step and (
                    export.handle.poll().state == TransferState.DONE):
                self._channels.release(export.plan.address, channel)
            elif channel is not None:
                channel.close()

    def _stream(self, export: _Export) -> None:
        header, tel, deadline = export.header, export.handle.telemetry, export.deadline
        fault, delay_s = self.wire_faults.pop(export.plan.request_id, ("", 0.0))
        if fault == "drop":
            raise KVTransferError("fault injection: this transfer is dropped")
        if fault == "delay":
            time.sleep(min(delay_s, remaining(deadline, "delaying the send (fault injection)")))
        if not self._open(export):  # failed or cancelled while connecting
            return
        reader, channel = export.reader, export.channel
        assert reader is not None and channel is not None
        # Layers follow the header without waiting: the receiver answers the header (ACCEPTED,
        # or why not) while they flow, and the answer is picked up between layers.
        accepted = False
        for layer in range(header.num_layers):
            job = self._next_job(export)
            assert isinstance(job, _LayerJob) and job.layer == layer, f"layer {layer} expected"
            tel.queue_s += time.monotonic() - job.enqueued
            if not accepted and not channel.is_quiet():
                reply = reader.read_reply(deadline)
                if reply.outcome != ReplyOutcome.ACCEPTED:
                    self._finish(export, reply)  # the channel is left mid-transfer: closed
                    return
                accepted = True
            t0 = time.perf_counter()
            parts = pack_layer(header, layer, job.kv)
            tel.pack_s += time.perf_counter() - t0
            if fault == "corrupt" and layer == 0:
                parts = _flip_a_byte(parts)
            self._send(export, parts)
        job = self._next_job(export)
        assert isinstance(job, _TrailerJob), "the trailer follows the last layer"
        self._send(export, record_frame(FrameKind.TRAILER, BlobTrailer(
            header.transfer_id, header.num_layers, job.first_token_id)))
        reply = reader.read_reply(deadline)
        if not accepted and reply.outcome == ReplyOutcome.ACCEPTED:
            reply = reader.read_reply(deadline)
        export.in_step = reply.outcome in (ReplyOutcome.COMMITTED, ReplyOutcome.DUPLICATE)
        self._finish(export, reply)

    def _open(self, export: _Export) -> bool:
        """Takes a channel to the receiver (an idle one if the pool has it) and sends the
        header; False if the transfer ended meanwhile."""
        channel, reused = self._channels.acquire(export.plan.address, export.deadline)
        export.channel, export.reader = channel, BlobReader(channel)
        if export.handle.poll().is_terminal:  # fail() missed the new channel: close it
            channel.close()
            return False
        export.handle.telemetry.reused_channel = reused
        self._send(export, record_frame(FrameKind.HEADER, export.header))
        export.handle.mark_transferring()
        return True

    def _finish(self, export: _Export, reply: TransferReply) -> None:
        tel, now = export.handle.telemetry, time.monotonic()
        if reply.transfer_id != export.plan.transfer_id:
            raise BlobFormatError(f"reply is for transfer {reply.transfer_id}, not "
                                  f"{export.plan.transfer_id}")
        tel.validate_s, tel.place_s = reply.validate_s, reply.place_s
        start, end = export.compute_start, export.compute_end
        if start is not None and end is not None:
            tel.overlap_s = sum(max(0.0, min(e, end) - max(s, start)) for s, e in export.send_spans)
            tel.exposed_s = max(0.0, now - end)
        if reply.outcome in (ReplyOutcome.COMMITTED, ReplyOutcome.DUPLICATE):
            export.handle.finish()  # DUPLICATE: an earlier delivery was committed
        else:
            export.fail(TransferRejected(f"receiver rejected transfer {reply.transfer_id}: "
                                         f"{reply.error_kind}: {reply.message}", reply.error_kind))

    @staticmethod
    def _explain(export: _Export, error: TruncatedTransfer) -> KVTransferError:
        """A receiver that rejects a transfer mid-stream replies, then closes: our send
        breaks, but its reason may be waiting to be read."""
        if export.reader is None or export.handle.poll().is_terminal:
            return error
        try:
            reply = export.reader.read_reply(time.monotonic() + 0.5)
        except KVTransferError:
            return error
        if reply.outcome != ReplyOutcome.REJECTED:
            return error
        return TransferRejected(f"receiver rejected transfer {reply.transfer_id}: "
                                f"{reply.error_kind}: {reply.message}", reply.error_kind)

    def _next_job(self, export: _Export) -> _LayerJob | _TrailerJob:
        try:
            job = export.jobs.get(timeout=remaining(export.deadline, "waiting for the prefill"))
        except queue.Empty:
            raise TransferTimeout("the prefill did not produce the KV before the transfer "
                                  "deadline") from None
        if job is None:
            raise TransferCancelled("transfer was cancelled")
        return job

    def _send(self, export: _Export, parts: list[Buffer]) -> None:
        assert export.channel is not None
        start = time.monotonic()
        export.channel.send(parts, export.deadline)
        end = time.monotonic()
        export.send_spans.append((start, end))
        tel = export.handle.telemetry
        tel.wire_s += end - start
        tel.wire_bytes += sum(len(memoryview(p).cast("B")) for p in parts)


def _flip_a_byte(parts: list[Buffer]) -> list[Buffer]:
    """Fault injection: the last part (the layer's payload) with its middle byte flipped."""
    payload = bytearray(memoryview(parts[-1]).cast("B"))
    payload[len(payload) // 2] ^= 0xFF
    return [*parts[:-1], bytes(payload)]
