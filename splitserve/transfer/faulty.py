"""Fault injection on the KV wire: a channel source that breaks one transfer, wrapped
around a sender's real one, so the send path itself (export.py) has no fault branches.

    KVSender.arm_fault(rid, WireFault(kind, seconds))    worker's fault injector
    the transfer of rid takes its channel from FaultyChannels(pool, fault):
      DROP      acquire raises: nothing is sent; the receiver's deadline runs out
      DELAY     acquire sleeps `seconds` (within the transfer deadline), then connects
      CORRUPT   the channel flips a byte of layer 0's payload: the receiver's checksum
                fails and it rejects the transfer
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from splitserve.errors import KVTransferError
from splitserve.transfer.blob import PRELUDE, FrameKind
from splitserve.transfer.transport import Buffer, Channel, ChannelSource, remaining


class WireFaultKind(Enum):
    """The values are the fault kinds' names in the cluster protocol's FaultSpec."""
    DROP = "drop_kv"
    CORRUPT = "corrupt_kv"
    DELAY = "delay_kv"


@dataclass(frozen=True, slots=True)
class WireFault:
    kind: WireFaultKind
    seconds: float = 0.0  # DELAY: how late the send starts


class FaultyChannels(ChannelSource):
    """`inner` as one armed transfer sees it (one instance per transfer)."""

    def __init__(self, inner: ChannelSource, fault: WireFault) -> None:
        self.inner, self.fault = inner, fault

    def acquire(self, address: str, deadline: float) -> tuple[Channel, bool]:
        kind = self.fault.kind
        if kind is WireFaultKind.DROP:
            raise KVTransferError("fault injection: this transfer is dropped")
        if kind is WireFaultKind.DELAY:
            time.sleep(min(self.fault.seconds,
                           remaining(deadline, "delaying the send (fault injection)")))
            return self.inner.acquire(address, deadline)
        channel, reused = self.inner.acquire(address, deadline)
        return _CorruptingChannel(channel), reused

    def release(self, address: str, channel: Channel) -> None:
        if isinstance(channel, _CorruptingChannel):
            channel.close()  # it carried a corrupted frame: never reused
        else:
            self.inner.release(address, channel)


class _CorruptingChannel(Channel):
    """Sends what it is given, except layer 0's frame: its last part (the payload)
    with the middle byte flipped, after the prelude's checksum was computed."""

    def __init__(self, inner: Channel) -> None:
        self.inner = inner

    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        _, kind, _, layer, _, _ = PRELUDE.unpack(memoryview(parts[0]).cast("B")[:PRELUDE.size])
        if kind == FrameKind.LAYER and layer == 0:
            payload = bytearray(memoryview(parts[-1]).cast("B"))
            payload[len(payload) // 2] ^= 0xFF
            parts = [*parts[:-1], bytes(payload)]
        self.inner.send(parts, deadline)

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        self.inner.recv_into(buf, deadline)

    def close(self) -> None:
        self.inner.close()

    def is_quiet(self) -> bool:
        return self.inner.is_quiet()
