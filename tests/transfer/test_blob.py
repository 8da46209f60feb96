"""The blob format: encode/decode round-trips exactly, and every corruption, truncation or
extension of a valid blob, and every frame not tagged under the transfer's key, raises a
typed KVTransferError (never wrong data)."""
from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import splitserve.transfer.blob as blob_module
from splitserve.errors import (BlobFormatError, ChecksumMismatch, KVTransferError,
                               TruncatedTransfer)
from splitserve.transfer.blob import (MAX_RECORD_BYTES, PRELUDE, BlobHeader, BlobReader,
                                      BlobTrailer, BytesSource, FrameKind, TransferReply,
                                      ReplyOutcome, decode_blob, encode_blob, pack_record,
                                      record_frame, unpack_record)
from splitserve.transfer.layer_codec import (DTYPES, Compression, decode_layer, encode_layer,
                                             layer_nbytes)
from splitserve.transfer.mac import NO_TAG, FrameMac, new_key
from splitserve.transfer.transport import Buffer

KEY = new_key()


@st.composite
def blobs(draw: st.DrawFn) -> tuple[BlobHeader, list[torch.Tensor], BlobTrailer]:
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    start = draw(st.integers(0, 3)) * block_size
    end = start + draw(st.integers(1, 3 * block_size + 1))
    num_blocks = -(-end // block_size) - start // block_size
    shape = (2, num_blocks, block_size, draw(st.integers(1, 3)), draw(st.integers(1, 8)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    compression = draw(st.sampled_from(list(Compression)))
    num_layers = draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    layers = [(torch.randn(shape, generator=gen) * 3).to(DTYPES[dtype]) for _ in range(num_layers)]
    header = BlobHeader(
        transfer_id=draw(st.text(min_size=1, max_size=40)),
        fingerprint=draw(st.text("0123456789abcdef", min_size=32, max_size=32)),
        request_id=draw(st.text(max_size=40)),
        namespace=draw(st.none() | st.text(max_size=20)),
        block_hashes=tuple(draw(st.binary(min_size=16, max_size=16))
                           for _ in range(end // block_size - start // block_size)),
        start_token=start, end_token=end, num_layers=num_layers, layer_shape=shape,
        dtype=dtype, compression=compression,
        layer_nbytes=(layer_nbytes(shape, dtype, compression),) * num_layers)
    trailer = BlobTrailer(header.transfer_id, num_layers, draw(st.integers(0, 2**31)))
    return header, layers, trailer


def _encode(header: BlobHeader, layers: list[torch.Tensor], trailer: BlobTrailer) -> bytes:
    parts: list[list[Buffer]] = [list(encode_layer(kv, header.compression)) for kv in layers]
    return encode_blob(header, parts, trailer, KEY)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blobs())
def test_round_trip(blob: tuple[BlobHeader, list[torch.Tensor], BlobTrailer]) -> None:
    header, layers, trailer = blob
    got_header, got_layers, got_trailer = decode_blob(_encode(header, layers, trailer), KEY)
    assert got_header == header and got_trailer == trailer
    for kv, got in zip(layers, got_layers):
        assert got.dtype == kv.dtype and got.shape == kv.shape
        if header.compression is Compression.NONE:  # bit-exact
            assert torch.equal(got.reshape(-1).view(torch.uint8), kv.reshape(-1).view(torch.uint8))
        else:  # int8: within half a quantization step (+ rounding to the cache dtype)
            ref = kv.float()
            step = ref.abs().amax(dim=(2, 3, 4), keepdim=True) / 127
            err = (got.float() - ref).abs()
            assert bool((err <= step * 0.5 + ref.abs() * 1e-2 + 1e-6).all())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blobs(), st.data())
def test_any_corruption_is_detected(blob: tuple[BlobHeader, list[torch.Tensor], BlobTrailer],
                                    data: st.DataObject) -> None:
    encoded = bytearray(_encode(*blob))
    pos = data.draw(st.integers(0, len(encoded) - 1), label="position")
    length = data.draw(st.integers(1, 8), label="length")
    noise = data.draw(st.binary(min_size=length, max_size=length), label="noise")
    original = bytes(encoded[pos:pos + length])
    encoded[pos:pos + length] = bytes(a ^ (b or 1) for a, b in zip(original, noise))
    with pytest.raises(KVTransferError):
        decode_blob(bytes(encoded), KEY)


@settings(max_examples=60, deadline=None)
@given(blobs(), st.data())
def test_truncation_and_trailing_bytes_are_detected(
        blob: tuple[BlobHeader, list[torch.Tensor], BlobTrailer], data: st.DataObject) -> None:
    encoded = _encode(*blob)
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(TruncatedTransfer):
        decode_blob(encoded[:cut], KEY)
    with pytest.raises(BlobFormatError):
        decode_blob(encoded + data.draw(st.binary(min_size=1, max_size=30), label="extra"), KEY)


def _header(**changes: object) -> BlobHeader:
    shape = (2, 3, 4, 2, 8)
    base = BlobHeader("t", "f" * 32, "r", None, (b"a" * 16, b"b" * 16), 0, 10, 2, shape,
                      "float32", Compression.NONE, (layer_nbytes(shape, "float32",
                                                                 Compression.NONE),) * 2)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize("changes", [
    {"version": 1}, {"mac": "xxh3_64"}, {"dtype": "int4"}, {"layer_shape": (2, 3, 4, 2)},
    {"start_token": 2}, {"end_token": 13}, {"block_hashes": (b"a" * 16,)},
    {"layer_nbytes": (1, 1)}, {"num_layers": 0, "layer_nbytes": ()},
])
def test_malformed_headers_are_rejected(changes: dict[str, object]) -> None:
    _header().check()
    with pytest.raises(BlobFormatError):
        _header(**changes).check()


def test_records_reject_unknown_fields_and_wrong_types() -> None:
    good = pack_record(TransferReply("t", ReplyOutcome.COMMITTED))
    assert unpack_record(TransferReply, good).outcome == ReplyOutcome.COMMITTED
    record = msgpack.unpackb(good)
    for bad in ({**record, "extra": 1}, {k: v for k, v in record.items() if k != "message"},
                {**record, "outcome": "0"}, {**record, "outcome": 9}, {**record, "place_s": True}):
        with pytest.raises(BlobFormatError):
            unpack_record(TransferReply, msgpack.packb(bad))
    with pytest.raises(BlobFormatError):
        unpack_record(BlobTrailer, b"\xc1")  # never-used msgpack byte


def test_huge_claimed_record_is_rejected_before_allocating() -> None:
    prelude = PRELUDE.pack(b"SSKV", FrameKind.HEADER, 0, 0, MAX_RECORD_BYTES + 1, NO_TAG)
    with pytest.raises(BlobFormatError):
        BlobReader(BytesSource(prelude)).read_header(float("inf"), KEY)


def test_frames_in_the_wrong_order_are_rejected() -> None:
    mac = FrameMac(KEY, "t")
    trailer = b"".join(bytes(p) for p in record_frame(FrameKind.TRAILER, BlobTrailer("t", 1, 5),
                                                      mac))
    with pytest.raises(BlobFormatError):
        BlobReader(BytesSource(trailer)).read_header(float("inf"), KEY)


def test_layer_checksum_names_the_layer() -> None:
    header = _header()
    layers = [torch.randn(header.layer_shape) for _ in range(2)]
    encoded = bytearray(_encode(header, layers, BlobTrailer("t", 2, 1)))
    header_len = PRELUDE.size + struct.unpack_from("<Q", encoded, 8)[0]
    second_layer_body = header_len + 2 * PRELUDE.size + header.layer_nbytes[0]
    encoded[second_layer_body + 5] ^= 0x40
    with pytest.raises(ChecksumMismatch, match="layer 1"):
        decode_blob(bytes(encoded), KEY)


def test_payloads_read_in_many_chunks_round_trip_and_check_every_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Payloads are received and hashed chunk by chunk (RECV_CHUNK): with 256-byte chunks a
    1536-byte layer takes 6; the bytes come back exactly, and a flip in the last chunk of
    the last layer is caught."""
    monkeypatch.setattr(blob_module, "RECV_CHUNK", 256)
    header = _header()
    layers = [torch.randn(header.layer_shape) for _ in range(2)]
    encoded = bytearray(_encode(header, layers, BlobTrailer("t", 2, 1)))
    _, got, _ = decode_blob(bytes(encoded), KEY)
    assert all(torch.equal(a, b) for a, b in zip(got, layers))
    trailer_len = len(b"".join(bytes(p) for p in record_frame(
        FrameKind.TRAILER, BlobTrailer("t", 2, 1), FrameMac(KEY, "t"))))
    encoded[len(encoded) - trailer_len - 3] ^= 0x01  # the last chunk of layer 1
    with pytest.raises(ChecksumMismatch, match="layer 1"):
        decode_blob(bytes(encoded), KEY)


def test_int8_handles_zero_and_tiny_blocks() -> None:
    kv = torch.zeros(2, 3, 4, 2, 8)
    kv[0, 1] = 1e-42  # subnormal: 1/scale overflows
    kv[1, 2, 0, 0, 0] = -5.0
    scales, q = encode_layer(kv, Compression.INT8)
    payload = torch.frombuffer(bytearray(bytes(scales) + bytes(q)), dtype=torch.uint8)
    got = decode_layer(payload, tuple(kv.shape), "float32", Compression.INT8)
    assert torch.allclose(got, kv, atol=1e-30)
    assert got[1, 2, 0, 0, 0] == -5.0
