"""Moving KV between engines (DESIGN.md 4.3): the blob format, validation, transports
(in-process, shared memory, TCP) and per-transfer telemetry. See docs/transfer.md.

    from splitserve.transfer import KVReceiver, KVSender, get_transport

Imports are lazy, so a process that only moves bytes (`splitserve.transfer.tcp`) does
not pay for torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.transfer.blob import BlobHeader, BlobTrailer, decode_blob, encode_blob
    from splitserve.transfer.handle import TransferHandle, TransferPlan
    from splitserve.transfer.layer_codec import Compression
    from splitserve.transfer.receiver import KVReceiver
    from splitserve.transfer.sender import KVSender
    from splitserve.transfer.telemetry import TransferTelemetry
    from splitserve.transfer.transport import (Channel, Listener, Transport, TransferState,
                                               TransferStatus, get_transport)

_EXPORTS = {
    "BlobHeader": "blob", "BlobTrailer": "blob", "decode_blob": "blob", "encode_blob": "blob",
    "TransferHandle": "handle", "TransferPlan": "handle", "Compression": "layer_codec",
    "KVReceiver": "receiver", "KVSender": "sender", "TransferTelemetry": "telemetry",
    "Channel": "transport", "Listener": "transport", "Transport": "transport",
    "TransferState": "transport", "TransferStatus": "transport", "get_transport": "transport",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitserve.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(f"splitserve.transfer.{module}"), name)
