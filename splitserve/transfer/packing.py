"""Packing an engine's KV into blob frames: the header of a transfer and one frame per
layer. The sender streams these; `held_blob_frames` builds a whole blob for tools and
tests that drive a channel by hand. `check_fits` is the receiving side's mirror of
`build_header`: does a header describe the import an engine expects?"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.kv_connector import KVConnector, KVLayout, KVRange
from splitserve.errors import FingerprintMismatch, HeaderMismatch
from splitserve.transfer.blob import BlobHeader, BlobTrailer, FrameKind, frame, record_frame
from splitserve.transfer.handle import TransferPlan
from splitserve.transfer.layer_codec import DTYPE_NAMES, Compression, encode_layer, layer_nbytes
from splitserve.transfer.mac import FrameMac
from splitserve.transfer.transport import Buffer


def build_header(layout: KVLayout, plan: TransferPlan, namespace: str | None,
                 block_hashes: Sequence[bytes], compression: Compression) -> BlobHeader:
    """The header of `plan`'s transfer from an engine of `layout`, whose full blocks in
    the range hash to `block_hashes`."""
    bs = layout.block_size
    if plan.start_token % bs or not 0 <= plan.start_token < plan.end_token:
        raise ValueError(f"plan range [{plan.start_token}, {plan.end_token}) must be "
                         f"non-empty and start on a block boundary (block size {bs})")
    shape = layout.layer_shape(-(-plan.end_token // bs) - plan.start_token // bs)
    dtype = DTYPE_NAMES[layout.dtype]
    nbytes = layer_nbytes(shape, dtype, compression)
    header = BlobHeader(
        transfer_id=plan.transfer_id, fingerprint=layout.fingerprint,
        request_id=plan.request_id, namespace=namespace, block_hashes=tuple(block_hashes),
        start_token=plan.start_token, end_token=plan.end_token,
        num_layers=layout.num_layers, layer_shape=shape, dtype=dtype,
        compression=compression, layer_nbytes=(nbytes,) * layout.num_layers)
    header.check()
    return header


def check_fits(layout: KVLayout, plan: TransferPlan, target: KVRange, header: BlobHeader) -> None:
    """Compatibility of a well-formed header with the receiving engine (`layout`) and the
    import it expects (`plan`, `target`): FingerprintMismatch or HeaderMismatch if not."""
    kv_dtype = DTYPE_NAMES[layout.dtype]
    if header.fingerprint != layout.fingerprint:
        raise FingerprintMismatch(
            f"KV for request {header.request_id!r} comes from model fingerprint "
            f"{header.fingerprint}, this engine is {layout.fingerprint}: the engines "
            "differ in model, weights, KV dtype or block size; route the request to a "
            "prefill worker serving the same model configuration")
    if header.request_id != plan.request_id:
        raise HeaderMismatch(f"transfer {plan.transfer_id} is for request "
                             f"{plan.request_id!r} but the header is for {header.request_id!r}")
    if header.namespace != plan.namespace:
        raise HeaderMismatch(f"KV of request {plan.request_id!r} is from cache namespace "
                             f"{header.namespace!r}, expected {plan.namespace!r}")
    if (header.start_token, header.end_token) != (target.start_token, target.end_token):
        raise HeaderMismatch(f"KV covers tokens [{header.start_token}, {header.end_token}), "
                             f"the import needs [{target.start_token}, {target.end_token})")
    if list(header.block_hashes) != list(target.block_hashes):
        raise HeaderMismatch(f"block hashes of request {plan.request_id!r} differ: the "
                             "sender computed KV for other tokens")
    shape = layout.layer_shape(len(target.block_ids))
    if (header.layer_shape, header.num_layers, header.dtype) != (
            shape, layout.num_layers, kv_dtype):
        raise HeaderMismatch(f"layout {list(header.layer_shape)} x {header.num_layers} "
                             f"{header.dtype} does not fit {list(shape)} x "
                             f"{layout.num_layers} {kv_dtype}")


def pack_layer(header: BlobHeader, layer: int, kv: torch.Tensor, mac: FrameMac) -> list[Buffer]:
    """One LAYER frame, tagged under `mac`, from a private copy `kv` of the layer's blocks
    (modified: the unused slots of the last block are zeroed, so no stale bytes of another
    request leave)."""
    num_blocks, block_size = header.layer_shape[1], header.layer_shape[2]
    num_valid = header.end_token - header.start_token - (num_blocks - 1) * block_size
    kv[:, -1, num_valid:] = 0
    return frame(FrameKind.LAYER, encode_layer(kv, header.compression), layer, mac)


def held_blob_frames(engine: KVConnector, plan: TransferPlan, first_token_id: int, *,
                     namespace: str | None = None,
                     compression: Compression = Compression.NONE) -> list[bytes]:
    """Every frame (header, layers, trailer) of a transfer of a held request's KV, as
    bytes, tagged under the plan's key: for tools and tests that drive a channel by hand.
    Engine thread."""
    kv = engine.export_kv(plan.request_id)
    skip = plan.start_token // engine.kv_layout.block_size
    header = build_header(engine.kv_layout, plan, namespace, kv.block_hashes[skip:],
                          compression)
    mac = FrameMac(plan.key, plan.transfer_id)
    frames = [record_frame(FrameKind.HEADER, header, mac)]
    with torch.inference_mode():
        frames += [pack_layer(header, i, engine.read_kv_layer(i, kv.block_ids[skip:]), mac)
                   for i in range(header.num_layers)]
    frames.append(record_frame(FrameKind.TRAILER, BlobTrailer(
        header.transfer_id, header.num_layers, first_token_id), mac))
    return [b"".join(bytes(memoryview(p).cast("B")) for p in parts) for parts in frames]
