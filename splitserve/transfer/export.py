"""One outgoing KV transfer (the prefill side): its header, lease, the queue of layers the
engine thread copied out for it, and the send thread that streams them.

    KVSender (engine thread)             Export.run (send thread)
    layer i copied -> jobs.put(layer) -> zero tail, encode, MAC, one write
    first token    -> jobs.put(trailer) -> trailer, then the receiver's answer
    fail(error)    -> jobs.put(None) and channel.close(): wakes the send thread

The send thread takes a channel from the sender's pool, sends the header and follows it
with the layers without waiting for the answer, which it picks up between layers; it gives
the channel back only when the whole transfer and its answer crossed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.errors import (BlobFormatError, KVTransferError, TransferCancelled,
                               TransferRejected, TransferTimeout, TruncatedTransfer)
from splitserve.transfer.blob import (BlobHeader, BlobReader, BlobTrailer, FrameKind,
                                      ReplyOutcome, TransferReply, record_frame)
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.mac import FrameMac
from splitserve.transfer.packing import pack_layer
from splitserve.transfer.telemetry import TransferTelemetry
from splitserve.transfer.transport import (Buffer, Channel, ChannelSource, TransferState,
                                           remaining)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LayerJob:
    layer: int
    kv: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], a private copy
    enqueued: float


@dataclass(slots=True)
class TrailerJob:
    first_token_id: int


class Export:
    """One outgoing transfer: its header, job queue, send thread and lease. The engine
    thread owns every field but `channel`, `reader`, `in_step` and `send_spans`."""

    def __init__(self, plan: TransferPlan, header: BlobHeader, telemetry: TransferTelemetry,
                 deadline: float, on_finish: Callable[[], None] | None = None) -> None:
        self.plan, self.header = plan, header
        self.mac = FrameMac(plan.key, plan.transfer_id)  # tags our frames, checks the replies
        self.handle = TransferHandle(plan.transfer_id, plan.request_id, telemetry, on_finish)
        self.deadline = deadline  # transfer deadline == lease expiry of the held blocks
        self.jobs: queue.SimpleQueue[LayerJob | TrailerJob | None] = queue.SimpleQueue()
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

    def run(self, channels: ChannelSource) -> None:
        """The send thread: streams the transfer on a channel from `channels` (given back
        if the transfer ended in step)."""
        try:
            with torch.inference_mode():  # layers copied in the forward are inference tensors
                self._stream(channels)
        except TruncatedTransfer as exc:
            self.fail(self._explain(exc))
        except KVTransferError as exc:
            self.fail(exc)
        except Exception as exc:  # a bug: fail the transfer, never hang it
            logger.exception("KV send of %s failed", self.plan.request_id)
            self.fail(KVTransferError(f"internal error while sending: {exc!r}"))
        finally:
            channel, self.channel = self.channel, None
            if channel is not None and self.in_step and (
                    self.handle.poll().state == TransferState.DONE):
                channels.release(self.plan.address, channel)
            elif channel is not None:
                channel.close()

    def _stream(self, channels: ChannelSource) -> None:
        header, tel, deadline = self.header, self.handle.telemetry, self.deadline
        if not self._open(channels):  # failed or cancelled while connecting
            return
        reader, channel = self.reader, self.channel
        assert reader is not None and channel is not None
        # Layers follow the header without waiting: the receiver answers the header (ACCEPTED,
        # or why not) while they flow, and the answer is picked up between layers.
        accepted = False
        for layer in range(header.num_layers):
            job = self._next_job()
            assert isinstance(job, LayerJob) and job.layer == layer, f"layer {layer} expected"
            tel.queue_s += time.monotonic() - job.enqueued
            if not accepted and not channel.is_quiet():
                reply = reader.read_reply(deadline)
                if reply.outcome != ReplyOutcome.ACCEPTED:
                    self._finish(reply)  # the channel is left mid-transfer: closed
                    return
                accepted = True
            t0 = time.perf_counter()
            parts = pack_layer(header, layer, job.kv, self.mac)
            tel.pack_s += time.perf_counter() - t0
            self._send(parts)
        job = self._next_job()
        assert isinstance(job, TrailerJob), "the trailer follows the last layer"
        self._send(record_frame(FrameKind.TRAILER, BlobTrailer(
            header.transfer_id, header.num_layers, job.first_token_id), self.mac))
        reply = reader.read_reply(deadline)
        if not accepted and reply.outcome == ReplyOutcome.ACCEPTED:
            reply = reader.read_reply(deadline)
        self.in_step = reply.outcome in (ReplyOutcome.COMMITTED, ReplyOutcome.DUPLICATE)
        self._finish(reply)

    def _open(self, channels: ChannelSource) -> bool:
        """Takes a channel to the receiver (an idle one if the pool has it) and sends the
        header; False if the transfer ended meanwhile."""
        channel, reused = channels.acquire(self.plan.address, self.deadline)
        self.channel, self.reader = channel, BlobReader(channel, self.mac)
        if self.handle.poll().is_terminal:  # fail() missed the new channel: close it
            channel.close()
            return False
        self.handle.telemetry.reused_channel = reused
        self._send(record_frame(FrameKind.HEADER, self.header, self.mac))
        self.handle.mark_transferring()
        return True

    def _finish(self, reply: TransferReply) -> None:
        tel, now = self.handle.telemetry, time.monotonic()
        if reply.transfer_id != self.plan.transfer_id:
            raise BlobFormatError(f"reply is for transfer {reply.transfer_id}, not "
                                  f"{self.plan.transfer_id}")
        tel.validate_s, tel.place_s = reply.validate_s, reply.place_s
        start, end = self.compute_start, self.compute_end
        if start is not None and end is not None:
            tel.overlap_s = sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.send_spans)
            tel.exposed_s = max(0.0, now - end)
        if reply.outcome in (ReplyOutcome.COMMITTED, ReplyOutcome.DUPLICATE):
            self.handle.finish()  # DUPLICATE: an earlier delivery was committed
        else:
            self.fail(TransferRejected(f"receiver rejected transfer {reply.transfer_id}: "
                                         f"{reply.error_kind}: {reply.message}", reply.error_kind))

    def _explain(self, error: TruncatedTransfer) -> KVTransferError:
        """A receiver that rejects a transfer mid-stream replies, then closes: our send
        breaks, but its reason may be waiting to be read."""
        if self.reader is None or self.handle.poll().is_terminal:
            return error
        try:
            reply = self.reader.read_reply(time.monotonic() + 0.5)
        except KVTransferError:
            return error
        if reply.outcome != ReplyOutcome.REJECTED:
            return error
        return TransferRejected(f"receiver rejected transfer {reply.transfer_id}: "
                                f"{reply.error_kind}: {reply.message}", reply.error_kind)

    def _next_job(self) -> LayerJob | TrailerJob:
        try:
            job = self.jobs.get(timeout=remaining(self.deadline, "waiting for the prefill"))
        except queue.Empty:
            raise TransferTimeout("the prefill did not produce the KV before the transfer "
                                  "deadline") from None
        if job is None:
            raise TransferCancelled("transfer was cancelled")
        return job

    def _send(self, parts: list[Buffer]) -> None:
        assert self.channel is not None
        start = time.monotonic()
        self.channel.send(parts, self.deadline)
        end = time.monotonic()
        self.send_spans.append((start, end))
        tel = self.handle.telemetry
        tel.wire_s += end - start
        tel.wire_bytes += sum(len(memoryview(p).cast("B")) for p in parts)

