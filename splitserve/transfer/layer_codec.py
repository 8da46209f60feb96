"""One layer's K/V payload on the wire: raw bytes of the engine's KV dtype, or int8 with a
scale per (K|V, block).

A layer payload holds `[2 (K,V), num_blocks, block_size, num_kv_heads, head_dim]` values:

    NONE   the tensor's bytes, C order, little-endian, in the header's dtype
    INT8   scales: float32 [2, num_blocks]        (absmax / 127 of each K or V block)
           values: int8    [2, num_blocks, block_size, num_kv_heads, head_dim]

int8 is a wire format only: the receiver dequantizes into its cache dtype, so it halves
(bf16) or quarters (fp32) the bytes at the price of rounding error in the imported KV.
"""
from __future__ import annotations

import math
import sys
from enum import Enum

import torch

from splitserve.errors import BlobFormatError

assert sys.byteorder == "little", "the KV wire format is little-endian"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class Compression(str, Enum):
    """How a layer's K/V values are encoded on the wire (the value is the header's name)."""
    NONE = "none"
    INT8 = "int8"


def layer_nbytes(shape: tuple[int, ...], dtype: str, compression: Compression) -> int:
    """Wire bytes of one layer payload of `shape` ([2, blocks, block_size, heads, dim])."""
    numel = math.prod(shape)
    if compression is Compression.INT8:
        return 4 * shape[0] * shape[1] + numel
    return numel * DTYPES[dtype].itemsize


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying (bf16 included)."""
    assert t.is_contiguous() and t.device.type == "cpu", "pack a contiguous CPU tensor"
    return t.reshape(-1).view(torch.uint8).numpy().data


def encode_layer(kv: torch.Tensor, compression: Compression) -> list[memoryview]:
    """The parts of one layer payload (zero-copy views for NONE). `kv` must not change
    until the parts were sent."""
    kv = kv.contiguous()
    if compression is Compression.NONE:
        return [byte_view(kv)]
    flat = kv.reshape(kv.shape[0] * kv.shape[1], -1)  # [2 * num_blocks, block values]
    scales = flat.abs().amax(dim=1).float() / 127.0
    # Multiply by the reciprocal and round: |x| * 127 / absmax <= 127, so no clamp is
    # needed (~3x faster than dividing and clamping on our CPUs). An all-zero (or
    # subnormal) block has no finite reciprocal: its values encode as 0.
    inverse = (1.0 / scales).nan_to_num_(0.0, posinf=0.0)
    q = (flat.float() * inverse[:, None]).round_().to(torch.int8)
    return [byte_view(scales.contiguous()), byte_view(q)]


def decode_layer(payload: torch.Tensor, shape: tuple[int, ...], dtype: str,
                 compression: Compression) -> torch.Tensor:
    """The [2, blocks, block_size, heads, dim] tensor in `dtype` from a uint8 payload of
    `layer_nbytes(...)` bytes (raw: a view of `payload`, no copy)."""
    if payload.numel() != layer_nbytes(shape, dtype, compression):
        raise BlobFormatError(f"layer payload has {payload.numel()} bytes, expected "
                              f"{layer_nbytes(shape, dtype, compression)}")
    if compression is Compression.NONE:
        return payload.view(DTYPES[dtype]).view(shape)
    num_scales = shape[0] * shape[1]
    scales = payload[:4 * num_scales].view(torch.float32).view(shape[0], shape[1])
    q = payload[4 * num_scales:].view(torch.int8).view(shape)
    if not bool(torch.isfinite(scales).all()):
        raise BlobFormatError("int8 layer payload has non-finite scales")
    return (q.float() * scales[:, :, None, None, None]).to(DTYPES[dtype])


def empty_payload(nbytes: int) -> tuple[torch.Tensor, memoryview]:
    """A fresh uint8 tensor to receive a payload into, and its writable byte view."""
    payload = torch.empty(nbytes, dtype=torch.uint8)
    return payload, payload.numpy().data
