"""Each transport is an ordered, reliable byte stream with deadlines: big gathered writes
arrive intact, waits end at their deadline, and a closed or dead peer ends the stream."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from splitserve.errors import TransferRejected, TransferTimeout, TruncatedTransfer
from splitserve.transfer.inproc import InProcTransport
from splitserve.transfer.shm import ShmTransport
from splitserve.transfer.tcp import TcpTransport
from splitserve.transfer.transport import (Channel, ChannelPool, Transport, get_transport,
                                           supported_transports)


def _small(name: str) -> Transport:
    """Transports with small buffers, so wrap-around and back-pressure show up quickly."""
    return {"inproc": lambda: InProcTransport(capacity=1 << 20),
            "shm": lambda: ShmTransport(data_ring_bytes=1 << 20, reply_ring_bytes=64 << 10),
            "tcp": TcpTransport}[name]()


@pytest.fixture(params=["inproc", "shm", "tcp"])
def channel_pair(request: pytest.FixtureRequest) -> Iterator[tuple[Channel, Channel]]:
    transport = _small(request.param)
    listener = transport.listen()
    sender = transport.connect(listener.address, time.monotonic() + 5)
    receiver = listener.accept(time.monotonic() + 5)
    assert receiver is not None
    yield sender, receiver
    sender.close()
    receiver.close()
    listener.close()


def _recv(chan: Channel, n: int, timeout: float = 10.0) -> bytes:
    buf = bytearray(n)
    chan.recv_into(memoryview(buf), time.monotonic() + timeout)
    return bytes(buf)


def test_large_gathered_writes_arrive_in_order(channel_pair: tuple[Channel, Channel]) -> None:
    sender, receiver = channel_pair
    parts = [os.urandom(24), os.urandom(3 << 20), b"", os.urandom(777)]  # > the 1 MiB ring
    expected = b"".join(parts) * 2
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_recv(receiver, len(expected))))
    reader.start()
    sender.send(parts, time.monotonic() + 10)
    sender.send([memoryview(b"".join(parts))], time.monotonic() + 10)
    reader.join(timeout=20)
    assert got == [expected]
    receiver.send([b"reply"], time.monotonic() + 5)  # the other direction works too
    assert _recv(sender, 5) == b"reply"


def test_receive_times_out_at_its_deadline(channel_pair: tuple[Channel, Channel]) -> None:
    _, receiver = channel_pair
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        _recv(receiver, 10, timeout=0.2)
    assert time.monotonic() - start < 5


def test_peer_close_ends_the_stream_after_the_data(channel_pair: tuple[Channel, Channel]) -> None:
    sender, receiver = channel_pair
    sender.send([b"abc"], time.monotonic() + 5)
    sender.close()
    assert _recv(receiver, 3) == b"abc"
    with pytest.raises(TruncatedTransfer):
        _recv(receiver, 1)


def test_close_from_another_thread_wakes_a_blocked_receive(
        channel_pair: tuple[Channel, Channel]) -> None:
    _, receiver = channel_pair
    threading.Timer(0.1, receiver.close).start()
    with pytest.raises(TruncatedTransfer):
        _recv(receiver, 10, timeout=10)


def test_send_to_a_stalled_reader_times_out(channel_pair: tuple[Channel, Channel]) -> None:
    sender, _ = channel_pair
    chunk = bytes(8 << 20)
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        for _ in range(16):  # 128 MiB: more than any socket buffer or ring
            sender.send([chunk], time.monotonic() + 0.3)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("name", ["inproc", "shm", "tcp"])
def test_connecting_to_nobody_is_rejected(name: str) -> None:
    transport = get_transport(name)
    listener = transport.listen()
    address = listener.address
    listener.close()
    with pytest.raises(TransferRejected):
        transport.connect(address, time.monotonic() + 2)


def test_registry_lists_what_is_supported() -> None:
    assert supported_transports() == ["inproc", "shm", "tcp"]
    assert get_transport("tcp") is get_transport("tcp")
    with pytest.raises(KeyError, match="inproc.*shm.*tcp"):
        get_transport("rdma")


def test_tcp_listens_on_loopback_by_default() -> None:
    listener = get_transport("tcp").listen()
    try:
        assert listener.address.startswith("tcp://127.0.0.1:")
    finally:
        listener.close()


def test_a_reply_sent_before_the_peer_closed_outlives_our_failed_send(
        channel_pair: tuple[Channel, Channel]) -> None:
    """A receiver that rejects mid-stream answers, then closes without reading the rest:
    the sender's writes break, but the answer (why) must still be readable."""
    sender, receiver = channel_pair

    def reject() -> None:
        _recv(receiver, 1000)
        receiver.send([b"no"], time.monotonic() + 5)
        receiver.close()
    peer = threading.Thread(target=reject)
    peer.start()
    with pytest.raises(TruncatedTransfer):
        for _ in range(40):  # 160 MiB: more than any buffer, so a write must break
            sender.send([bytes(4 << 20)], time.monotonic() + 10)
    peer.join(timeout=10)
    assert _recv(sender, 2) == b"no"


def _wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Polls `predicate` (a close takes a moment to reach the other end on some transports)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_idle_channel_knows_whether_it_can_carry_more(
        channel_pair: tuple[Channel, Channel]) -> None:
    sender, receiver = channel_pair
    for _ in range(2):  # wraps the 1 MiB shm ring
        sender.send([os.urandom(700 << 10)], time.monotonic() + 10)
        _recv(receiver, 700 << 10)
    receiver.send([b"ok"], time.monotonic() + 5)
    assert _recv(sender, 2) == b"ok"
    assert sender.is_quiet() and receiver.is_quiet()  # in step: reusable
    assert sender.is_quiet()  # the check consumes nothing
    receiver.send([b"unasked"], time.monotonic() + 5)
    assert _wait_until(lambda: not sender.is_quiet())  # bytes nobody read: out of step
    receiver.close()
    assert not receiver.is_quiet()


def test_an_idle_channel_sees_its_peer_close(channel_pair: tuple[Channel, Channel]) -> None:
    sender, receiver = channel_pair
    assert sender.is_quiet()
    receiver.close()
    assert _wait_until(lambda: not sender.is_quiet())


@pytest.mark.parametrize("name", ["inproc", "shm", "tcp"])
def test_channel_pool_reuses_idle_channels_that_are_alive(name: str) -> None:
    listener = get_transport(name).listen()
    pool = ChannelPool(max_idle_per_address=1)
    accepted: list[Channel] = []
    try:
        first, reused = pool.acquire(listener.address, time.monotonic() + 5)
        assert not reused
        first.send([b"ping"], time.monotonic() + 5)
        peer = listener.accept(time.monotonic() + 5)
        assert peer is not None
        accepted.append(peer)
        assert _recv(peer, 4) == b"ping"
        pool.release(listener.address, first)
        assert pool.acquire(listener.address, time.monotonic() + 5) == (first, True)
        extra, reused = pool.acquire(listener.address, time.monotonic() + 5)  # none idle
        assert extra is not first and not reused
        pool.release(listener.address, first)
        pool.release(listener.address, extra)  # over max_idle_per_address: closed
        assert extra.is_quiet() is False
        peer.close()  # the receiver goes away: its idle channel is not handed out
        assert _wait_until(lambda: not first.is_quiet())
        fresh, reused = pool.acquire(listener.address, time.monotonic() + 5)
        assert fresh is not first and not reused
        pool.release(listener.address, fresh)
        pool.close()  # closes idle channels: the receiver sees the stream end
        assert not fresh.is_quiet()
    finally:
        pool.close()
        for chan in accepted:
            chan.close()
        listener.close()


def test_channel_pool_does_not_reuse_a_channel_idle_too_long() -> None:
    listener = get_transport("inproc").listen()
    pool = ChannelPool(max_idle_s=0.0)
    try:
        chan, _ = pool.acquire(listener.address, time.monotonic() + 5)
        pool.release(listener.address, chan)
        again, reused = pool.acquire(listener.address, time.monotonic() + 5)
        assert again is not chan and not reused and not chan.is_quiet()
    finally:
        pool.close()
        listener.close()
