"""The KV transfer blob (DESIGN.md 4.3): framing, header/trailer/reply records, and the
reader that validates a stream frame by frame. Byte layout: docs/transfer.md.

A transfer is a stream of frames; each frame is a fixed 48-byte prelude and a body:

    prelude  "<4sBBHQ32s": magic b"SSKV" | kind u8 | flags u8 (0) | layer u16
                           | body_len u64 | tag: nonce || Poly1305 of the body (mac.py)
    sender -> receiver   HEADER          LAYER 0 .. LAYER n-1, TRAILER
    receiver -> sender          REPLY(accepted | rejected | duplicate)  REPLY(committed | rejected)

The receiver answers the header as soon as it checked it; the sender does not wait for the
answer but picks it up between layers and stops at a refusal, so an incompatible transfer
costs about a round trip's worth of layers. The receiver drops the rest of a transfer it
refused at the header (see receiver.py), which keeps the channel in step.

HEADER, TRAILER and REPLY bodies are msgpack maps; LAYER bodies are raw K/V bytes
(layer_codec.py). Nothing is unpickled. The reader checks every prelude field, the order of
frames, each body's length against the header *before* allocating, and each tag under the
transfer's key, so a corrupted, forged, truncated or reordered stream raises a typed
error, never yields data. Replies are tagged too when the receiver knows the transfer's
key; an untagged one is believed only when it refuses (it can fail a transfer, which a
reset connection could as well, but never complete one).
"""
from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, Protocol, TypeVar

import msgpack
import torch

from splitserve.errors import BlobFormatError, ChecksumMismatch, TruncatedTransfer
from splitserve.transfer.layer_codec import (DTYPES, Compression, decode_layer, empty_payload,
                                             layer_nbytes)
from splitserve.transfer.mac import MAC_NAME, NO_TAG, TAG_BYTES, FrameMac
from splitserve.transfer.transport import Buffer

BLOB_FORMAT_VERSION = 3  # 2: HMAC-SHA256 tags replace xxh3_64; 3: Poly1305 tags (mac.py)
MAGIC = b"SSKV"
PRELUDE = struct.Struct(f"<4sBBHQ{TAG_BYTES}s")
# Cap on header/trailer/reply bodies, checked before allocating (a 1M-token range has
# 62.5K block hashes: ~1.1 MB of header).
MAX_RECORD_BYTES = 2 << 20
RECV_CHUNK = 1 << 20  # payloads are received and MACed chunk by chunk, while in cache (L2)


class FrameKind(IntEnum):
    HEADER = 1
    LAYER = 2
    TRAILER = 3
    REPLY = 4


class ReplyOutcome(IntEnum):
    COMMITTED = 0  # the receiver committed the KV
    DUPLICATE = 1  # this transfer was already committed; send nothing more
    REJECTED = 2  # the receiver refused or failed it; nothing was committed
    ACCEPTED = 3  # the header fits the expected import: the layers will be kept


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """What a transfer carries; the receiver checks it against its import before any KV."""
    transfer_id: str
    fingerprint: str  # model fingerprint (DESIGN 4.2) of the sending engine
    request_id: str
    namespace: str | None
    block_hashes: tuple[bytes, ...]  # chained hashes of the full blocks in the range
    start_token: int  # token range [start_token, end_token); start is block-aligned
    end_token: int
    num_layers: int
    layer_shape: tuple[int, ...]  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    dtype: str  # the sender's KV cache dtype ("float32" | "bfloat16" | "float16")
    compression: Compression
    layer_nbytes: tuple[int, ...]  # wire bytes of each layer payload
    version: int = BLOB_FORMAT_VERSION
    mac: str = MAC_NAME

    def check(self) -> None:
        """Internal consistency (not compatibility): BlobFormatError if malformed."""
        if self.version != BLOB_FORMAT_VERSION:
            raise BlobFormatError(f"KV blob format version {self.version} is not supported "
                                  f"(this build reads {BLOB_FORMAT_VERSION}); upgrade the "
                                  "older worker")
        if self.mac != MAC_NAME:
            raise BlobFormatError(f"MAC algorithm {self.mac!r} is not supported")
        if self.dtype not in DTYPES:
            raise BlobFormatError(f"KV dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        shape = self.layer_shape
        if len(shape) != 5 or shape[0] != 2 or min(shape) <= 0:
            raise BlobFormatError(f"layer shape {list(shape)} is not [2, blocks, block_size, "
                                  "heads, head_dim]")
        block_size = shape[2]
        if not (0 <= self.start_token < self.end_token
                and self.start_token % block_size == 0
                and shape[1] == -(-self.end_token // block_size) - self.start_token // block_size
                and len(self.block_hashes) == self.end_token // block_size
                - self.start_token // block_size):
            raise BlobFormatError(f"token range [{self.start_token}, {self.end_token}), "
                                  f"{shape[1]} blocks and {len(self.block_hashes)} hashes "
                                  f"disagree (block size {block_size})")
        expected = layer_nbytes(shape, self.dtype, self.compression)
        if self.num_layers <= 0 or self.layer_nbytes != (expected,) * self.num_layers:
            raise BlobFormatError(f"per-layer byte lengths do not match {self.num_layers} "
                                  f"layers of {expected} bytes")

    def to_record(self) -> dict[str, Any]:
        return {**_fields_of(self), "compression": self.compression.value}


@dataclass(frozen=True, slots=True)
class BlobTrailer:
    """Ends a transfer: all layers were sent; carries the first token sampled by prefill."""
    transfer_id: str
    num_layers: int
    first_token_id: int


@dataclass(frozen=True, slots=True)
class TransferReply:
    """The receiver's verdict, sent back on the same channel."""
    transfer_id: str
    outcome: ReplyOutcome
    error_kind: str | None = None  # the receiver's error class name when REJECTED
    message: str = ""
    validate_s: float = 0.0  # receiver-side telemetry, merged by the sender
    place_s: float = 0.0


# -- records <-> msgpack ------------------------------------------------------------------
R = TypeVar("R", BlobHeader, BlobTrailer, TransferReply)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "transfer_id": (str,), "fingerprint": (str,), "request_id": (str,),
    "namespace": (str, type(None)), "block_hashes": (list,), "start_token": (int,),
    "end_token": (int,), "num_layers": (int,), "layer_shape": (list,), "dtype": (str,),
    "compression": (str,), "layer_nbytes": (list,), "version": (int,), "mac": (str,),
    "first_token_id": (int,), "outcome": (int,), "error_kind": (str, type(None)),
    "message": (str,), "validate_s": (float, int), "place_s": (float, int),
}


def pack_record(record: BlobHeader | BlobTrailer | TransferReply) -> bytes:
    data = record.to_record() if isinstance(record, BlobHeader) else _fields_of(record)
    return msgpack.packb(data, use_bin_type=True)


def _fields_of(record: BlobHeader | BlobTrailer | TransferReply) -> dict[str, Any]:
    """The record's fields as a dict (shallow: dataclasses.asdict deep-copies, ~10 us a
    record on the transfer's critical path)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


def unpack_record(cls: type[R], body: Buffer) -> R:
    """Parses a record, checking its exact field set and every field's type."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise BlobFormatError(f"{cls.__name__} is not valid msgpack: {exc}") from None
    names = [f.name for f in fields(cls)]
    if not isinstance(data, dict) or set(data) != set(names):
        got = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise BlobFormatError(f"{cls.__name__} has fields {got}, expected {sorted(names)}")
    for name in names:
        value = data[name]
        if not isinstance(value, _FIELD_TYPES[name]) or isinstance(value, bool):
            raise BlobFormatError(f"{cls.__name__}.{name} has type {type(value).__name__}")
    try:
        if cls is BlobHeader:
            if not all(isinstance(h, bytes) for h in data["block_hashes"]) or not all(
                    isinstance(x, int) for x in data["layer_shape"] + data["layer_nbytes"]):
                raise BlobFormatError("BlobHeader lists have elements of the wrong type")
            data.update(block_hashes=tuple(data["block_hashes"]),
                        layer_shape=tuple(data["layer_shape"]),
                        layer_nbytes=tuple(data["layer_nbytes"]),
                        compression=Compression(data["compression"]))
        elif cls is TransferReply:
            data["outcome"] = ReplyOutcome(data["outcome"])
    except ValueError as exc:
        raise BlobFormatError(f"{cls.__name__} has a bad value: {exc}") from None
    return cls(**data)


# -- frames ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Prelude:
    kind: int
    layer: int
    size: int
    tag: bytes


def parse_prelude(data: Buffer) -> Prelude:
    """The fields of a frame's prelude; BlobFormatError unless it is one of ours."""
    magic, kind, flags, layer, size, tag = PRELUDE.unpack(data)
    if magic != MAGIC or flags != 0:
        raise BlobFormatError(f"bad frame prelude (magic {magic!r}, flags {flags}); the "
                              "peer is not speaking the splitserve KV blob format")
    return Prelude(kind, layer, size, tag)


def check_record_prelude(prelude: Prelude, kind: FrameKind) -> None:
    """A HEADER/TRAILER/REPLY prelude in its place, with a body under the cap (checked
    before anything is allocated for the body)."""
    if prelude.kind != kind or prelude.layer != 0:
        raise BlobFormatError(f"expected a {kind.name} frame, got kind {prelude.kind} "
                              f"(layer field {prelude.layer})")
    if prelude.size > MAX_RECORD_BYTES:
        raise BlobFormatError(f"{kind.name} frame claims {prelude.size} bytes "
                              f"(> {MAX_RECORD_BYTES})")


def parse_header(body: Buffer) -> BlobHeader:
    """A well-formed header (not yet authenticated: its transfer id names the key)."""
    header = unpack_record(BlobHeader, body)
    header.check()
    return header


def frame(kind: FrameKind, parts: Sequence[Buffer], layer: int,
          mac: FrameMac | None) -> list[Buffer]:
    """The prelude followed by `parts` (not joined: a transport gathers them), tagged under
    `mac` (None: untagged, only for refusals to a peer whose transfer has no known key)."""
    size = sum(len(memoryview(part).cast("B")) for part in parts)
    tag = NO_TAG if mac is None else mac.tag(kind, layer, size, parts)
    return [PRELUDE.pack(MAGIC, kind, 0, layer, size, tag), *parts]


def record_frame(kind: FrameKind, record: BlobHeader | BlobTrailer | TransferReply,
                 mac: FrameMac | None) -> list[Buffer]:
    return frame(kind, [pack_record(record)], 0, mac)


class ByteSource(Protocol):
    def recv_into(self, buf: memoryview, deadline: float) -> None: ...


class BlobReader:
    """Reads and validates one transfer's frames from a byte source, in stream order,
    checking each frame's tag under `mac` (set by `read_header` when not given)."""

    def __init__(self, source: ByteSource, mac: FrameMac | None = None) -> None:
        self.source, self.mac = source, mac
        self.num_bytes = 0  # wire bytes read so far
        self.mac_s = 0.0  # time spent authenticating layer payloads
        self._prelude = bytearray(PRELUDE.size)
        self._prelude_view = memoryview(self._prelude)

    def read_header(self, deadline: float, key: bytes) -> BlobHeader:
        """The header, authenticated under `key` (the key of the transfer it names);
        later frames are checked under the same key."""
        prelude, body = self._read_raw(FrameKind.HEADER, deadline)
        header = parse_header(body)
        mac = FrameMac(key, header.transfer_id)
        if not mac.verify(FrameKind.HEADER, 0, body, prelude.tag):
            raise ChecksumMismatch(f"header of transfer {header.transfer_id} fails its "
                                   "authentication tag: forged, or corrupted in transit")
        self.mac = mac
        return header

    def read_trailer(self, header: BlobHeader, deadline: float) -> BlobTrailer:
        trailer = self._read_record(FrameKind.TRAILER, BlobTrailer, deadline)
        if trailer.transfer_id != header.transfer_id or trailer.num_layers != header.num_layers:
            raise BlobFormatError(f"trailer of transfer {trailer.transfer_id} "
                                  f"({trailer.num_layers} layers) ends transfer "
                                  f"{header.transfer_id} ({header.num_layers} layers)")
        return trailer

    def read_reply(self, deadline: float) -> TransferReply:
        """The receiver's answer. An untagged (or wrongly tagged) answer is taken only when
        it refuses: it can make a transfer fail, never make it count as delivered."""
        prelude, body = self._read_raw(FrameKind.REPLY, deadline)
        reply = unpack_record(TransferReply, body)
        if reply.outcome != ReplyOutcome.REJECTED and (
                self.mac is None or not self.mac.verify(FrameKind.REPLY, 0, body, prelude.tag)):
            raise ChecksumMismatch(f"a {reply.outcome.name} reply for transfer "
                                   f"{reply.transfer_id} fails its authentication tag: it "
                                   "does not come from the receiver that issued the plan")
        return reply

    def read_layer(self, header: BlobHeader, layer: int, deadline: float) -> torch.Tensor:
        """Layer `layer`'s [2, blocks, block_size, heads, dim] tensor in header.dtype."""
        nbytes = header.layer_nbytes[layer]
        tag = self._read_prelude(FrameKind.LAYER, deadline, layer, nbytes)
        payload, view = empty_payload(nbytes)
        mac = self._mac().start(FrameKind.LAYER, layer, nbytes, tag)
        for off in range(0, nbytes, RECV_CHUNK):
            chunk = view[off:off + RECV_CHUNK]
            self._recv(chunk, deadline)
            t0 = time.perf_counter()
            mac.update(chunk)
            self.mac_s += time.perf_counter() - t0
        if not FrameMac.matches(mac, tag):
            raise ChecksumMismatch(f"layer {layer} of transfer {header.transfer_id} fails its "
                                   "authentication tag: corrupted in transit or forged; "
                                   "retry the transfer")
        return decode_layer(payload, header.layer_shape, header.dtype, header.compression)

    def skip_layer(self, header: BlobHeader, layer: int, deadline: float) -> None:
        """Reads layer `layer`'s frame and drops it (unchecked: used to drain a refused
        transfer)."""
        nbytes = header.layer_nbytes[layer]
        self._read_prelude(FrameKind.LAYER, deadline, layer, nbytes)
        scratch = memoryview(bytearray(min(nbytes, RECV_CHUNK)))
        for off in range(0, nbytes, len(scratch)):
            self._recv(scratch[:min(len(scratch), nbytes - off)], deadline)

    def _mac(self) -> FrameMac:
        if self.mac is None:
            raise BlobFormatError("no transfer key: a transfer's frames are read after its "
                                  "authenticated header")
        return self.mac

    def _read_record(self, kind: FrameKind, cls: type[R], deadline: float) -> R:
        prelude, body = self._read_raw(kind, deadline)
        if not self._mac().verify(kind, 0, body, prelude.tag):
            raise ChecksumMismatch(f"{kind.name.lower()} frame fails its authentication tag")
        return unpack_record(cls, body)

    def _read_raw(self, kind: FrameKind, deadline: float) -> tuple[Prelude, bytes]:
        self._recv(self._prelude_view, deadline)
        prelude = parse_prelude(self._prelude)
        check_record_prelude(prelude, kind)
        body = bytearray(prelude.size)
        self._recv(memoryview(body), deadline)
        return prelude, bytes(body)

    def _read_prelude(self, kind: FrameKind, deadline: float, layer: int, size: int) -> bytes:
        self._recv(self._prelude_view, deadline)
        prelude = parse_prelude(self._prelude)
        if (prelude.kind, prelude.layer, prelude.size) != (kind, layer, size):
            raise BlobFormatError(f"expected {kind.name} frame {layer} of {size} bytes, got "
                                  f"kind {prelude.kind} layer {prelude.layer} of "
                                  f"{prelude.size} bytes")
        return prelude.tag

    def _recv(self, buf: memoryview, deadline: float) -> None:
        self.source.recv_into(buf, deadline)
        self.num_bytes += len(buf)


# -- whole blobs in memory (tests, tools) -------------------------------------------------
class BytesSource:
    """A ByteSource over bytes in memory; the end of the bytes is a truncated stream."""

    def __init__(self, data: Buffer) -> None:
        self._data = memoryview(data).cast("B")
        self.offset = 0

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        end = self.offset + len(buf)
        if end > len(self._data):
            raise TruncatedTransfer(f"blob ends at byte {len(self._data)}, a frame needs {end}")
        buf[:] = self._data[self.offset:end]
        self.offset = end


def encode_blob(header: BlobHeader, layers: Sequence[list[Buffer]], trailer: BlobTrailer,
                key: bytes) -> bytes:
    """A whole blob as bytes, tagged under `key`; `layers` are each layer's payload parts
    (layer_codec)."""
    mac = FrameMac(key, header.transfer_id)
    frames = record_frame(FrameKind.HEADER, header, mac)
    for i, parts in enumerate(layers):
        frames += frame(FrameKind.LAYER, parts, i, mac)
    frames += record_frame(FrameKind.TRAILER, trailer, mac)
    return b"".join(bytes(memoryview(p).cast("B")) for p in frames)


def decode_blob(data: Buffer, key: bytes) -> tuple[BlobHeader, list[torch.Tensor], BlobTrailer]:
    """Parses and authenticates a whole blob; a typed KVTransferError if anything is wrong."""
    source = BytesSource(data)
    reader = BlobReader(source)
    deadline = float("inf")
    header = reader.read_header(deadline, key)
    layers = [reader.read_layer(header, i, deadline) for i in range(header.num_layers)]
    trailer = reader.read_trailer(header, deadline)
    if source.offset != len(memoryview(data).cast("B")):
        raise BlobFormatError(f"{len(memoryview(data).cast('B')) - source.offset} bytes "
                              "follow the trailer")
    return header, layers, trailer

