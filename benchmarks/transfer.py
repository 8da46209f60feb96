"""KV transfer: throughput of each transport against the machine's raw ceilings, what
layer-wise streaming adds before the decode worker's first step, and what int8 KV on the
wire does to bytes, time and output, all measured in one run.

    python benchmarks/transfer.py            # ~3-5 min on 2 cores; writes docs/benchmarks.md
    python benchmarks/transfer.py --quick    # 1 repetition, 1K/4K tokens, no doc
    python benchmarks/transfer.py --no-ttft  # throughput only

Throughput (KV of 1K, 4K, 16K tokens of the default model: 30 layers x K/V x 3 heads x 64,
bf16, blocks of 16; random values, since 16K exceeds the model's 8K positions): the blob is
packed first (per-layer copy + checksum, "pack"; in real use this runs inside the prefill,
overlapped), then timed from taking a channel to the receiver's verdict: header, 30 layer
frames and trailer sent without waiting (ACCEPTED is read when it arrives), COMMITTED.
Channels stay open between transfers, as KVSender keeps them (transport.ChannelPool; the
warm-up round opens them). The receiver (another
process for shm/tcp, a thread for inproc) runs the real BlobReader: every layer is received
into a fresh tensor and checksummed. Ceilings in the same run: a plain `socket` loopback
copy of the same bytes (one sendall per layer into recv_into of a preallocated buffer,
another process, the connection kept open likewise) and a single-threaded `memcpy` (numpy
copyto) of the same bytes into a filled buffer. Each method runs in bursts of BURST
operations; the figures are the steady ones (a stream of transfers), and the first of each
burst (after the other methods) is reported apart.
Streaming and int8 agreement: benchmarks/transfer_handoff.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
from benchmarks.common import (DEFAULT_OUTPUT, CpuMonitor, ServeChild,  # noqa: E402
                          busy_processes, machine_description, markdown_table, median,
                          write_section)
from benchmarks.transfer_notes import NOTES  # noqa: E402
from benchmarks.transfer_handoff import (DEADLINE_S, HANDOFF_NOTES, TTFT_PROMPT,  # noqa: E402
                                    run_agreement, run_ttft, serve_decode)
from splitserve.transfer.blob import (BlobHeader, BlobReader, BlobTrailer, FrameKind,  # noqa: E402
                                      ReplyOutcome, TransferReply, record_frame)
from splitserve.transfer.layer_codec import Compression, layer_nbytes  # noqa: E402
from splitserve.transfer.mac import FrameMac  # noqa: E402
from splitserve.transfer.packing import pack_layer  # noqa: E402
from splitserve.errors import TruncatedTransfer  # noqa: E402
from splitserve.transfer.transport import (Buffer, ChannelPool, Transport,  # noqa: E402
                                           get_transport)

SIZES = [1024, 4096, 16384]
BENCH_KEY = bytes(32)  # the transfer key (a constant: the receiver may be a spawned child)
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16  # SmolLM2-135M (checked against the GGUF below)
_RAW_ACK = b"k"


# -- receivers (run in a child process, or a thread for inproc) -----------------------------
def serve_blobs(transport: Transport, address_out: list[str], stop: threading.Event) -> None:
    """Receives transfers one after another with the real reader (checksums, fresh tensors),
    on each channel until its sender closes it."""
    listener = transport.listen()
    address_out.append(listener.address)
    while not stop.is_set():
        chan = listener.accept(time.monotonic() + 0.5)
        if chan is None:
            continue
        try:
            while True:
                deadline = time.monotonic() + DEADLINE_S
                reader = BlobReader(chan)
                header = reader.read_header(deadline, BENCH_KEY)
                chan.send(record_frame(FrameKind.REPLY, TransferReply(
                    header.transfer_id, ReplyOutcome.ACCEPTED), reader.mac), deadline)
                for layer in range(header.num_layers):
                    reader.read_layer(header, layer, deadline)
                reader.read_trailer(header, deadline)
                chan.send(record_frame(FrameKind.REPLY, TransferReply(
                    header.transfer_id, ReplyOutcome.COMMITTED), reader.mac), deadline)
        except TruncatedTransfer:
            pass  # the sender closed the channel
        finally:
            chan.close()
    listener.close()


def serve_raw(address_out: list[str]) -> None:
    """Plain sockets: `u64 length` then that many bytes into a preallocated buffer, ack;
    again on the same connection until the sender closes it."""
    srv = socket.create_server(("127.0.0.1", 0))
    address_out.append("raw://127.0.0.1:%d" % srv.getsockname()[1])
    buf = memoryview(bytearray(0))
    while True:
        conn, _ = srv.accept()
        with conn:
            while (head := conn.recv(8, socket.MSG_WAITALL)):
                n = int.from_bytes(head, "little")
                if len(buf) < n:
                    buf = memoryview(bytearray(n))  # bytearray is zero-filled: pages are touched
                got = 0
                while got < n:
                    got += conn.recv_into(buf[got:n], min(n - got, 1 << 20))
                conn.sendall(_RAW_ACK)


def child_main(kind: str) -> None:
    """`--serve KIND`: prints the address, serves until stdin closes."""
    torch.set_num_threads(1)
    address: list[str] = []
    stop = threading.Event()
    if kind == "raw":
        threading.Thread(target=serve_raw, args=(address,), daemon=True).start()
    elif kind == "decode":
        threading.Thread(target=serve_decode, args=(address,), daemon=True).start()
    else:
        threading.Thread(target=serve_blobs, args=(get_transport(kind), address, stop),
                         daemon=True).start()
    while not address:
        time.sleep(0.01)
    print(address[0], flush=True)
    if kind == "decode":
        threading.Event().wait()  # serve_decode owns stdin and exits the process
    sys.stdin.read()
    stop.set()


# -- throughput ----------------------------------------------------------------------------
@dataclasses.dataclass
class Blob:
    header: BlobHeader
    frames: list[list[Buffer]]  # header, layers..., trailer
    layers: list[torch.Tensor]  # the unpacked layers (raw ceilings copy these bytes)
    pack_s: float

    @property
    def payload_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def wire_bytes(self) -> int:
        return sum(len(memoryview(p).cast("B")) for f in self.frames for p in f)


def make_blob(num_tokens: int, compression: Compression, seed: int) -> Blob:
    nb = -(-num_tokens // BLOCK)
    shape = (2, nb, BLOCK, HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(seed)
    layers = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    header = BlobHeader(uuid.uuid4().hex, "0" * 32, "bench", None,
                        tuple(os.urandom(16) for _ in range(num_tokens // BLOCK)), 0, num_tokens,
                        LAYERS, shape, "bfloat16", compression,
                        (layer_nbytes(shape, "bfloat16", compression),) * LAYERS)
    t0 = time.perf_counter()
    # pack_layer zeroes the last block's tail in place: pack a copy, as the engine's
    # read_kv_layer hands the sender one; the copy is part of the cost.
    mac = FrameMac(BENCH_KEY, header.transfer_id)
    frames = [pack_layer(header, i, kv.clone(), mac) for i, kv in enumerate(layers)]
    pack_s = time.perf_counter() - t0
    return Blob(header, [record_frame(FrameKind.HEADER, header, mac), *frames,
                         record_frame(FrameKind.TRAILER, BlobTrailer(header.transfer_id,
                                                                     LAYERS, 1), mac)],
                layers, pack_s)


_CHANNELS = ChannelPool()
_RAW_SOCKETS: dict[str, socket.socket] = {}


def send_blob(address: str, blob: Blob) -> float:
    """Seconds from taking a channel to the receiver's COMMITTED, sending as KVSender does:
    layers follow the header at once; the header's answer is picked up between layers."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + DEADLINE_S
    chan, _ = _CHANNELS.acquire(address, deadline)
    reader = BlobReader(chan, FrameMac(BENCH_KEY, blob.header.transfer_id))
    accepted = False
    for parts in blob.frames:
        if not accepted and not chan.is_quiet():
            assert reader.read_reply(deadline).outcome == ReplyOutcome.ACCEPTED
            accepted = True
        chan.send(parts, deadline)
    if not accepted:
        assert reader.read_reply(deadline).outcome == ReplyOutcome.ACCEPTED
    assert reader.read_reply(deadline).outcome == ReplyOutcome.COMMITTED
    elapsed = time.perf_counter() - t0
    _CHANNELS.release(address, chan)
    return elapsed


def send_raw(address: str, layers: Sequence[torch.Tensor]) -> float:
    views = [t.reshape(-1).view(torch.uint8).numpy().data for t in layers]
    total = sum(len(v) for v in views)
    t0 = time.perf_counter()
    sock = _RAW_SOCKETS.get(address)
    if sock is None:
        host, port = address.removeprefix("raw://").rsplit(":", 1)
        sock = _RAW_SOCKETS[address] = socket.create_connection((host, int(port)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(total.to_bytes(8, "little"))
    for v in views:
        sock.sendall(v)
    assert sock.recv(1) == _RAW_ACK
    return time.perf_counter() - t0


def memcpy(layers: Sequence[torch.Tensor], dst: np.ndarray) -> float:
    srcs = [t.reshape(-1).view(torch.uint8).numpy() for t in layers]
    t0 = time.perf_counter()
    off = 0
    for src in srcs:  # layer by layer, as transfers move them (one np.concatenate call
        np.copyto(dst[off:off + len(src)], src)  # is ~10% faster at 1K)
        off += len(src)
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / median(seconds) / 1e9


BURST = 4  # operations of a method in a row: the first follows the other methods, the rest
# follow the same method, as in a stream of transfers (steady state: the table's figures)


def run_throughput(sizes: Sequence[int], reps: int) -> tuple[list[list[object]], list[str]]:
    children = {k: ServeChild(__file__, k) for k in ("shm", "tcp", "raw")}
    inproc_addr: list[str] = []
    stop = threading.Event()
    threading.Thread(target=serve_blobs, args=(get_transport("inproc"), inproc_addr, stop),
                     daemon=True).start()
    while not inproc_addr:
        time.sleep(0.01)
    addresses = {"inproc": inproc_addr[0], **{k: c.address for k, c in children.items()}}
    rows: list[list[object]] = []
    verdicts: list[str] = []
    try:
        for n in sizes:
            blob, blob8 = make_blob(n, Compression.NONE, n), make_blob(n, Compression.INT8, n)
            dst = np.ones(blob.payload_bytes, np.uint8)
            ops: dict[str, Callable[[], float]] = {
                **{k: functools.partial(send_blob, addresses[k], blob)
                   for k in ("inproc", "shm", "tcp")},
                "tcp int8": functools.partial(send_blob, addresses["tcp"], blob8),
                "raw": functools.partial(send_raw, addresses["raw"], blob.layers),
                "memcpy": functools.partial(memcpy, blob.layers, dst)}
            steady: dict[str, list[float]] = {k: [] for k in ops}
            first: dict[str, list[float]] = {k: [] for k in ops}
            # Small sizes are quick and noisier: repeat them so each size moves about as many
            # bytes as the largest one does (5 rounds at 16K, 7 at 4K, 27 at 1K).
            rounds = max(reps, -(-reps * max(sizes) // n // (BURST - 1)))
            for r in range(rounds + 1):  # the first round warms up
                for name, op in ops.items():
                    for i in range(BURST):
                        elapsed = op()
                        if r:
                            (steady if i else first)[name].append(elapsed)
            nbytes = blob.payload_bytes
            g = {k: gbps(nbytes, v) for k, v in steady.items()}
            g1 = {k: gbps(nbytes, v) for k, v in first.items()}
            rows.append([
                f"{n // 1024}K", f"{nbytes / 1e6:.1f}", f"{nbytes / blob.pack_s / 1e9:.2f}",
                f"{g['inproc']:.2f}", f"{g['shm']:.2f}", f"{g['tcp']:.2f}",
                f"{g['tcp int8']:.2f} ({blob8.wire_bytes / 1e6:.1f} MB, pack "
                f"{nbytes / blob8.pack_s / 1e9:.2f})",
                f"{g['raw']:.2f}", f"{g['memcpy']:.2f}",
                f"**{g['tcp'] / g['raw']:.0%}**", f"**{g['shm'] / g['memcpy']:.0%}**",
                f"{g1['tcp'] / g1['raw']:.0%} / {g1['shm'] / g1['memcpy']:.0%}"])
            verdicts.append(f"{n // 1024}K: TCP {g['tcp'] / g['raw']:.0%} of raw socket "
                            f"(target >= 80%), shm {g['shm'] / g['memcpy']:.0%} of memcpy "
                            "(target >= 50%)")
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    finally:
        _CHANNELS.close()
        for sock in _RAW_SOCKETS.values():
            sock.close()
        _RAW_SOCKETS.clear()
        stop.set()
        for child in children.values():
            child.close()
    return rows, verdicts


# -- main ------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 repetition, 1K/4K, no doc")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-ttft", action="store_true", help="skip streaming and int8 agreement")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        child_main(args.serve)
        return 0
    torch.set_num_threads(2)
    from splitserve.model.loader import open_checkpoint
    spec = open_checkpoint(None).spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (LAYERS, HEADS, HEAD_DIM)
    reps = 1 if args.quick else args.reps
    sizes = SIZES[:2] if args.quick else SIZES
    monitor = CpuMonitor().start()
    rows, verdicts = run_throughput(sizes, reps)
    ttft_rows: list[list[object]] = []
    agreement: list[list[object]] = []
    if not args.no_ttft:
        ttft_rows, _ = run_ttft(reps)
        for row in ttft_rows:
            print(" | ".join(str(c) for c in row), flush=True)
        agreement = run_agreement(16 if args.quick else 32)
        for row in agreement:
            print(" | ".join(str(c) for c in row), flush=True)
    busy = monitor.stop()
    body = [
        f"Each round runs every method {BURST} times in a row ({reps} rounds at the largest "
        f"size, about {reps} x 16K / size / {BURST - 1} at smaller ones, after one warm-up "
        "round). Figures are medians of the steady operations (2nd to last of a burst: a "
        "stream of transfers); the last column gives the ratios for the first operation of "
        "each burst, which starts with the caches holding what the other methods left. "
        "GB/s = 1e9 bytes/s of KV payload (bf16), from taking a channel (kept open, as "
        "KVSender does) to the receiver's verdict. Other processes used "
        f"{busy:.2f} cores on average during the run"
        + (" (**busy machine: figures are distorted**)." if busy > 0.3 else "."),
        "", "### Throughput", "",
        markdown_table(["KV tokens", "payload MB", "pack GB/s", "inproc", "shm", "tcp",
                        "tcp + int8 (wire MB, pack GB/s)", "raw loopback socket", "memcpy",
                        "tcp / socket", "shm / memcpy",
                        "first of a burst: tcp / socket, shm / memcpy"], rows),
        "", *[f"- {v}" for v in verdicts],
    ]
    if ttft_rows:
        body += [
            "", f"### Layer-wise streaming: {TTFT_PROMPT}-token prompt, prompt arrival to the "
            "decode worker ready for its first step", "",
            markdown_table(["mode", "A's prefill alone, ms",
                            "A's prefill while transferring, ms",
                            "B ready after A's prefill ended, ms (share of prefill alone; "
                            "target <= +10%)", "arrival to B ready, ms (vs prefill alone)",
                            "min-max alone / arrival to ready, ms"], ttft_rows),
            "", "### int8 KV on the wire: greedy agreement with A alone (default model, bf16)",
            "", markdown_table(["KV on the wire", "prompts", "new tokens", "tokens equal",
                                "identical prefix per prompt"], agreement),
        ]
    body += ["", "### What was expected, and why the results differ", "", NOTES.rstrip()]
    if ttft_rows:
        body.append(HANDOFF_NOTES.rstrip())
    if busy > 0.3:
        body += ["", "Busy processes at the end of the run:", "",
                 *[f"    {line}" for line in busy_processes()]]
    text = "\n".join(body)
    print(text)
    if not args.quick:
        write_section(args.output, "KV transfer", text, machine=machine_description())
    return 0


if __name__ == "__main__":
    sys.exit(main())
