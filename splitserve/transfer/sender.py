"""The prefill side of a KV transfer: stream a request's prompt KV, layer by layer, while
the engine still computes, and hold its blocks under a lease until the receiver answers.

    engine thread (forward pass)            send thread (one per transfer)
    layer i done -> read_kv_layer (copy) --> zero tail, encode, MAC, one write
    step returns -> poll(outputs)        --> trailer(first token), wait for the reply
    poll(): reply or lease expiry        --> release_kv, exactly once

Every engine call (through its KV connector, engine/kv_connector.py) happens on the
engine thread: inside the layer listener or in `start` / `send_held` / `poll` / `cancel`,
which the worker calls between steps. The layer listener only copies the layer's blocks out (so the
bytes sent are a snapshot, whatever the engine does next) and enqueues them. The send
thread's side of a transfer is export.py.
"""
from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from splitserve.engine.batch import ScheduledBatch
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.output import RequestOutput
from splitserve.errors import KVImportError, TransferCancelled, TransferTimeout
from splitserve.kv_cache import root_hash
from splitserve.transfer.export import Export, LayerJob, TrailerJob
from splitserve.transfer.faulty import FaultyChannels, WireFault
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.layer_codec import Compression, layer_nbytes
from splitserve.transfer.packing import build_header
from splitserve.transfer.telemetry import TransferSide, TransferTelemetry
from splitserve.transfer.transport import ChannelPool, scheme
from splitserve.transfer.wakeup import Wakeup

logger = logging.getLogger(__name__)


class LayerStreaming(str, enum.Enum):
    """When a prefill's KV leaves layer by layer during the step that completes its prompt
    (each layer copied out as soon as it is computed) rather than after that step.

    Streamed, the transfer's threads (here and the receiver's) run beside the step's
    compute threads; where those hold every core, each preemption stalls their team and the
    step (so the first token) takes ~3x the transfer's CPU longer; after the step, the same
    CPU runs on cores the step left idle, and the decode worker starts the transfer's time
    later. On 2 cores (docs/benchmarks.md, 2026-12-06) a 512-token prompt's step took 51 ms
    longer streamed while its KV, sent after, arrived 17 ms after the step, 36 ms sooner than
    streamed (2048 tokens: +73 ms, 48 ms)."""

    # Streams when the transfer shares the cores with compute either way: the engine has
    # computing requests beyond the ones this step completes (their next step would), or its
    # compute leaves cores free (`compute_leaves_cores`). After the step otherwise.
    AUTO = "auto"
    ON = "on"  # every step that completes a transferred prompt streams
    OFF = "off"  # always after the step


def compute_leaves_cores(device: torch.device) -> bool:
    """Whether a transfer's threads find a core the engine's compute does not use: the
    step runs on an accelerator, or this process may run on more cores than torch has
    threads."""
    return device.type != "cpu" or len(os.sched_getaffinity(0)) > torch.get_num_threads()


class KVSender:
    """Sends prompt KV from `engine` (a prefill engine) to receivers named by plans.

    Usage on the engine thread:

        engine.add_request(rid, prompt, replace(params, max_tokens=1),
                           namespace=ns, hold_kv=True)
        handle = sender.start(rid, plan, namespace=ns)   # before the prefill step
        ... outputs = engine.step(); sender.poll(outputs) ...   # every step, and when idle
        handle.poll() -> Pending | Transferring | Done | Failed(reason)
    """

    def __init__(self, engine: KVConnector, *, compression: Compression = Compression.NONE,
                 stream_layers: LayerStreaming = LayerStreaming.AUTO,
                 spare_cores: bool = False) -> None:
        self.engine = engine
        self.compression = compression
        # Streamed, a prefill step that completes a transfer's prompt runs layer by layer
        # and each layer leaves as soon as it is computed; else the step runs in one call
        # and `poll` copies every layer after it (nothing of the transfer inside the step).
        self.stream_layers = stream_layers
        self.spare_cores = spare_cores  # AUTO streams every time (compute_leaves_cores)
        self.num_released = 0  # requests whose held KV this sender freed (exactly once each)
        self._exports: dict[str, Export] = {}
        self._faults: dict[str, WireFault] = {}  # armed, by request id (fault injection)
        self._chained = engine.layer_listener
        engine.layer_listener = self._on_step
        self._channels = ChannelPool()  # open channels to receivers, kept between transfers
        self.wakeup = Wakeup()  # set when a transfer ends: `poll` has KV to release

    # -- engine thread ------------------------------------------------------------------------
    def start(self, request_id: str, plan: TransferPlan, *, namespace: str | None = None,
              compression: Compression | None = None) -> TransferHandle:
        """Streams the prompt KV of a request added with `hold_kv=True` and not yet
        prefilled: each layer leaves as soon as the prefill step computed it, or every
        layer right after the step (`stream_layers`).
        `namespace` is the one the request was added with (checked against the engine)."""
        req = self.engine.request_state(request_id)
        if req is None or not req.hold_kv:
            raise KVImportError(f"request {request_id!r} is not a live request added with "
                                "hold_kv=True; add it before starting its transfer")
        if req.cache_root != root_hash(self.engine.kv_layout.fingerprint, namespace):
            raise ValueError(f"request {request_id!r} was added with another namespace than "
                             f"{namespace!r}; pass the namespace given to add_request")
        if plan.end_token != req.num_prefill_tokens:
            raise ValueError(f"plan covers tokens up to {plan.end_token} but the prompt has "
                             f"{req.num_prefill_tokens}; the two engines got different prompts")
        hashes = req.block_hashes[plan.start_token // self.engine.kv_layout.block_size:]
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
        skip = plan.start_token // self.engine.kv_layout.block_size
        export = self._new_export(request_id, plan, namespace, kv.block_hashes[skip:],
                                  compression)
        export.prefill_done = True
        self._copy_all_layers(export, kv.block_ids[skip:])
        export.jobs.put(TrailerJob(first_token_id))
        return export.handle

    def poll(self, outputs: Sequence[RequestOutput] = ()) -> list[TransferHandle]:
        """Call after every step with its outputs (and periodically when idle): ends the
        streams whose prefill finished, releases the KV of transfers that were answered,
        failed or whose lease expired. Returns the handles that finished since last time."""
        self.wakeup.clear()  # before looking: a transfer ending later sets it again
        now = time.monotonic()
        for out in outputs:
            export = self._exports.get(out.request_id)
            if export is not None and not export.prefill_done:
                self._on_prefill_output(export, out, now)
        finished = []
        for request_id, export in list(self._exports.items()):
            if not export.prefill_done and self.engine.request_state(request_id) is None:
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

    def arm_fault(self, request_id: str, fault: WireFault) -> None:
        """Fault injection: the request's next transfer takes its channel through
        `FaultyChannels`, which drops, delays or corrupts it."""
        self._faults[request_id] = fault

    def cancel(self, request_id: str) -> None:
        """Stops the request's transfer; its KV is released by the next `poll`."""
        self._faults.pop(request_id, None)
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
        if self.engine.layer_listener == self._on_step:
            self.engine.layer_listener = self._chained
        self._channels.close()
        self.wakeup.close()

    # -- before and inside the forward pass (engine thread) ----------------------------------
    def _on_step(self, batch: ScheduledBatch) -> Callable[[int], None] | None:
        """The layer callback for a step that completes a streamed prompt; None for any
        other step, so it runs its layers in one call."""
        chained = self._chained(batch) if self._chained is not None else None
        streams = (self._streams_completing_in(batch)
                   if self._exports and self.stream_layers is not LayerStreaming.OFF else [])
        if not streams or not self._streaming_pays(streams):
            return chained
        for export, _ in streams:
            export.compute_start = time.monotonic()

        def on_layer(layer: int) -> None:
            if chained is not None:
                chained(layer)
            self._copy_layer(layer, streams)
        return on_layer

    def _copy_layer(self, layer: int, streams: list[tuple[Export, list[int]]]) -> None:
        for export, block_ids in streams:
            if export.layers_copied != layer:
                continue
            t0 = time.perf_counter()
            kv = self.engine.read_kv_layer(layer, block_ids)
            export.handle.telemetry.pack_s += time.perf_counter() - t0
            export.handle.telemetry.layers_during_compute += 1
            export.jobs.put(LayerJob(layer, kv, time.monotonic()))
            export.layers_copied += 1

    def _streams_completing_in(self, batch: ScheduledBatch) -> list[tuple[Export, list[int]]]:
        """Exports whose prompt's last token is computed in this step (so every layer's KV
        of the whole range is in the cache once that layer ran), with their block ids."""
        bs = self.engine.kv_layout.block_size
        streams = []
        for seq in batch.seqs:
            export = self._exports.get(seq.request_id)
            if (export is None or export.layers_copied or export.handle.poll().is_terminal
                    or seq.start_pos + len(seq.token_ids) != export.header.end_token):
                continue
            first = export.header.start_token // bs
            streams.append((export, seq.block_table[first:first + export.header.layer_shape[1]]))
        return streams

    def _streaming_pays(self, streams: list[tuple[Export, list[int]]]) -> bool:
        """AUTO: whether the transfers of `streams` would share the cores with compute
        even if sent after this step (LayerStreaming)."""
        if self.stream_layers is LayerStreaming.ON or self.spare_cores:
            return True
        return self.engine.num_computing_requests > len(streams)

    # -- helpers (engine thread) ----------------------------------------------------------
    def _new_export(self, request_id: str, plan: TransferPlan, namespace: str | None,
                    block_hashes: Sequence[bytes], compression: Compression | None) -> Export:
        if request_id in self._exports:
            raise ValueError(f"request {request_id!r} already has a transfer in progress")
        if plan.request_id != request_id:
            raise ValueError(f"plan is for request {plan.request_id!r}, not {request_id!r}")
        compression = self.compression if compression is None else compression
        header = build_header(self.engine.kv_layout, plan, namespace, block_hashes, compression)
        shape, dtype = header.layer_shape, header.dtype
        telemetry = TransferTelemetry(
            plan.transfer_id, request_id, scheme(plan.address), TransferSide.SENDER,
            compression=compression.value, num_layers=header.num_layers,
            num_tokens=plan.end_token - plan.start_token,
            payload_bytes=layer_nbytes(shape, dtype, Compression.NONE) * header.num_layers)
        export = Export(plan, header, telemetry, time.monotonic() + plan.timeout_s,
                        self.wakeup.set)
        fault = self._faults.pop(request_id, None)
        channels = self._channels if fault is None else FaultyChannels(self._channels, fault)
        export.thread = threading.Thread(target=export.run, args=(channels,), daemon=True,
                                         name=f"kv-send-{request_id}")
        self._exports[request_id] = export
        export.thread.start()
        return export

    def _on_prefill_output(self, export: Export, out: RequestOutput, now: float) -> None:
        # Output tokens before the first one sampled here (a resumed request has some).
        num_resumed = export.header.end_token - len(out.prompt_token_ids)
        if len(out.token_ids) <= num_resumed:  # aborted or failed before sampling
            export.prefill_done = True
            export.fail(TransferCancelled(f"request {out.request_id!r} finished "
                                          f"({out.finish_reason}) before its first token"))
            return
        export.prefill_done = True
        export.compute_end = now
        if export.handle.poll().is_terminal:  # cancelled meanwhile: nothing to send
            return
        if export.layers_copied < export.header.num_layers:
            # The prefill ran before start() (or without streaming): copy from held blocks.
            try:
                kv = self.engine.export_kv(out.request_id)
            except KVImportError as exc:
                export.fail(TransferCancelled(f"KV of {out.request_id!r} is not held: {exc}"))
                return
            first = export.header.start_token // self.engine.kv_layout.block_size
            self._copy_all_layers(export, kv.block_ids[first:])
        export.jobs.put(TrailerJob(out.token_ids[num_resumed]))

    def _copy_all_layers(self, export: Export, block_ids: list[int]) -> None:
        for layer in range(export.layers_copied, export.header.num_layers):
            t0 = time.perf_counter()
            kv = self.engine.read_kv_layer(layer, block_ids)
            export.handle.telemetry.pack_s += time.perf_counter() - t0
            export.jobs.put(LayerJob(layer, kv, time.monotonic()))
            export.layers_copied += 1

    def _release(self, export: Export) -> None:
        """Frees the request's held blocks, exactly once (release_kv is idempotent too)."""
        if not export.released:
            export.released = True
            self.engine.release_kv(export.plan.request_id)
            self.num_released += 1
