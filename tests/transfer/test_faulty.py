"""Fault injection on the KV wire (transfer/faulty.py): an armed transfer is dropped,
delayed or corrupted by the channel wrapper; the others go through untouched, and every
failure frees its blocks on both sides."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import pytest

from splitserve.errors import ChecksumMismatch, KVTransferError, TransferTimeout
from splitserve.transfer.blob import PRELUDE
from splitserve.transfer.faulty import FaultyChannels, WireFault, WireFaultKind
from splitserve.transfer.handle import TransferHandle, TransferPlan
from splitserve.transfer.transport import Buffer, Channel, ChannelPool, TransferState
from tests.transfer.conftest import PARAMS, PROMPT, Pair, prefill_frames


def start_armed(pair: Pair, fault: WireFault, *, timeout_s: float = 30.0,
                rid: str = "r") -> tuple[TransferHandle, TransferHandle]:
    plan = pair.expect(rid, PROMPT, PARAMS, timeout_s=timeout_s)
    pair.a.engine.add_request(rid, PROMPT, dataclasses.replace(PARAMS, max_tokens=1),
                              hold_kv=True)
    pair.sender.arm_fault(rid, fault)
    return pair.sender.start(rid, plan), pair.receiver_handle(plan)


def test_a_dropped_transfer_never_reaches_the_receiver(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    send, recv = start_armed(pair, WireFault(WireFaultKind.DROP), timeout_s=1.0)
    pair.pump(send, recv)
    error = send.poll().error
    assert isinstance(error, KVTransferError) and "dropped" in str(error)
    assert isinstance(recv.poll().error, TransferTimeout)  # nothing came: the deadline
    assert recv.telemetry.wire_bytes == 0


@pytest.mark.parametrize("transport", ["inproc", "tcp"])
def test_a_corrupted_transfer_is_rejected(make_pair: Callable[..., Pair], transport: str) -> None:
    pair = make_pair(transport)
    send, recv = start_armed(pair, WireFault(WireFaultKind.CORRUPT))
    pair.pump(send, recv)
    assert isinstance(recv.poll().error, ChecksumMismatch)
    # NOTE: over TCP the receiver's close may break the send before its reply is read.
    assert send.poll().state == TransferState.FAILED
    tokens, _, _ = pair.handoff("next", PROMPT, PARAMS)  # not armed: goes through
    assert len(tokens) == PARAMS.max_tokens


def test_a_delayed_transfer_arrives_late_and_intact(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("tcp")
    reference, _, _ = pair.handoff("ref", PROMPT, PARAMS)
    started = time.monotonic()
    send, recv = start_armed(pair, WireFault(WireFaultKind.DELAY, seconds=0.5))
    pair.pump(send, recv)
    assert time.monotonic() - started >= 0.5
    assert send.poll().state == recv.poll().state == TransferState.DONE
    assert pair.decode(recv) == reference


class RecordingChannel(Channel):
    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.closed = False

    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        self.sent.append(b"".join(bytes(memoryview(p).cast("B")) for p in parts))

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        raise AssertionError("not read in this test")

    def close(self) -> None:
        self.closed = True


class OneChannel(ChannelPool):
    """A pool that hands out one recording channel and keeps what comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.channel = RecordingChannel()
        self.released: list[Channel] = []

    def acquire(self, address: str, deadline: float) -> tuple[Channel, bool]:
        return self.channel, False

    def release(self, address: str, channel: Channel) -> None:
        self.released.append(channel)


def test_corruption_flips_one_byte_of_layer_0_only(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair("inproc")
    plan = TransferPlan("t", "r", None, pair.receiver.address, 0, len(PROMPT), 30.0)
    frames = prefill_frames(pair, plan)  # header, layer 0, layer 1, trailer
    pool = OneChannel()
    channels = FaultyChannels(pool, WireFault(WireFaultKind.CORRUPT))
    channel, _ = channels.acquire(plan.address, time.monotonic() + 5)
    for frame in frames:  # as the sender sends them: the prelude, then the body
        channel.send([frame[:PRELUDE.size], frame[PRELUDE.size:]], time.monotonic() + 5)
    sent = pool.channel.sent
    assert [i for i, (a, b) in enumerate(zip(frames, sent)) if a != b] == [1]
    flipped = [i for i, (a, b) in enumerate(zip(frames[1], sent[1])) if a != b]
    assert len(flipped) == 1 and flipped[0] >= PRELUDE.size  # in the payload
    channels.release(plan.address, channel)  # a corrupting channel is never reused
    assert pool.released == [] and pool.channel.closed


def test_a_delayed_channel_goes_back_to_the_pool() -> None:
    pool = OneChannel()
    channels = FaultyChannels(pool, WireFault(WireFaultKind.DELAY, seconds=0.0))
    channel, reused = channels.acquire("inproc://x", time.monotonic() + 5)
    assert channel is pool.channel and not reused
    channels.release("inproc://x", channel)
    assert pool.released == [pool.channel]
