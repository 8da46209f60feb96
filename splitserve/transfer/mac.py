"""Frame authentication of a KV transfer: HMAC-SHA256 under a per-transfer key.

The receiver draws a fresh random key for every plan it issues (`TransferPlan.key`); the
plan reaches the sender over the control plane, never over the KV link. Every frame's tag
covers a context (a domain string, the frame kind, the layer index, the body length and
the transfer id) followed by the body, so a frame cannot be moved to another position, to
another transfer, or cut short without its tag failing; a transfer's frames can only be
made by a holder of its key. A keyed MAC has no nonce, so re-sending a transfer (a retry,
a duplicate delivery) is safe, unlike one-time authenticators (Poly1305, GMAC).

Why HMAC-SHA256 and not keyed BLAKE2b: both are in hashlib; on the machines we measured
OpenSSL's SHA-256 (SHA-NI) ran at 1.6 GB/s against 0.9 GB/s for BLAKE2b (docs/transfer.md,
"Authentication"). Tags are compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence

from splitserve.transfer.transport import Buffer

KEY_BYTES = 32
TAG_BYTES = 32
MAC_NAME = "hmac-sha256"
NO_TAG = bytes(TAG_BYTES)  # replies to peers that proved nothing carry no tag
# domain, kind, layer, body_len, len(transfer_id); then the transfer id, then the body
_CONTEXT = struct.Struct("<8sBHQI")
_DOMAIN = b"SSKV-MAC"


def new_key() -> bytes:
    """A fresh per-transfer key (the receiver makes one per plan)."""
    return secrets.token_bytes(KEY_BYTES)


def check_key(key: object) -> None:
    """ValueError unless `key` is a transfer key (a plan from the wire is checked)."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a transfer key is {KEY_BYTES} bytes, got "
                         f"{len(key) if isinstance(key, bytes) else type(key).__name__}")


class FrameMac:
    """Tags and checks the frames of one transfer (`key`, `transfer_id`)."""

    def __init__(self, key: bytes, transfer_id: str) -> None:
        check_key(key)
        self._base = hmac.new(key, digestmod=hashlib.sha256)  # copied per frame: no re-keying
        self._transfer_id = transfer_id.encode("utf-8", "surrogatepass")

    def start(self, kind: int, layer: int, size: int) -> hmac.HMAC:
        """A MAC over the frame's context, to be fed its body (in chunks as they land)."""
        mac = self._base.copy()
        mac.update(_CONTEXT.pack(_DOMAIN, kind, layer, size, len(self._transfer_id)))
        mac.update(self._transfer_id)
        return mac

    def tag(self, kind: int, layer: int, size: int, parts: Sequence[Buffer]) -> bytes:
        mac = self.start(kind, layer, size)
        for part in parts:
            mac.update(part)
        return mac.digest()

    @staticmethod
    def matches(mac: hmac.HMAC, tag: bytes) -> bool:
        return hmac.compare_digest(mac.digest(), tag)

    def verify(self, kind: int, layer: int, body: Buffer, tag: bytes) -> bool:
        mac = self.start(kind, layer, len(memoryview(body).cast("B")))
        mac.update(body)
        return self.matches(mac, tag)
