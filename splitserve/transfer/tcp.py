"""TCP transport: what crosses machines.

Each send is one gathered `sendmsg` of the caller's buffers (a frame's 24-byte prelude and
the tensor memory itself): no user-space join, no per-block messages. FlowKV's finding is
that fragmentation, not bandwidth, dominates KV transfer time, so the sender hands the
kernel one layer at a time (megabytes), and the receiver `recv_into`s straight into the
tensor that will hold the layer. Addresses are `tcp://host:port`; `listen()` binds
127.0.0.1 unless given another host.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

from splitserve.errors import TransferRejected, TransferTimeout, TruncatedTransfer
from splitserve.transfer.transport import (Buffer, Channel, Listener, SocketListener,
                                           Transport, close_socket, register_transport,
                                           remaining)

# Largest single recv: big enough to amortize the syscall, small enough that the receiver
# checksums bytes while they are still in cache (blob.py hashes each chunk as it lands).
RECV_CHUNK = 1 << 20
# Linux caps one sendmsg's iovec list (IOV_MAX); frames have 2-3 parts.
_MAX_IOV = 512


def parse_address(address: str) -> tuple[str, int]:
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"TCP address {address!r} must look like 'tcp://host:port'")
    return host.strip("[]"), int(port)


class TcpChannel(Channel):
    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._closed = False
        self._lock = threading.Lock()

    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        try:
            while views:
                self._sock.settimeout(remaining(deadline, "TCP send"))
                sent = self._sock.sendmsg(views[:_MAX_IOV])
                # Drop what went out; a partial send leaves a tail of the first unsent part.
                while sent and views:
                    if sent >= len(views[0]):
                        sent -= len(views[0])
                        views.pop(0)
                    else:
                        views[0] = views[0][sent:]
                        sent = 0
        except TimeoutError:
            raise TransferTimeout("TCP send passed its deadline: the receiver is not "
                                  "reading (stalled or overloaded)") from None
        except OSError as exc:
            raise TruncatedTransfer(f"TCP send failed: {exc}") from None

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        buf = buf.cast("B") if buf.format != "B" else buf
        filled = 0
        try:
            while filled < len(buf):
                self._sock.settimeout(remaining(deadline, "TCP receive"))
                n = self._sock.recv_into(buf[filled:], min(len(buf) - filled, RECV_CHUNK))
                if n == 0:
                    raise TruncatedTransfer(f"TCP peer closed the stream after {filled} of "
                                            f"{len(buf)} bytes of a frame")
                filled += n
        except TimeoutError:
            raise TransferTimeout(f"TCP receive passed its deadline after {filled} of "
                                  f"{len(buf)} bytes") from None
        except OSError as exc:
            raise TruncatedTransfer(f"TCP receive failed after {filled} of {len(buf)} "
                                    f"bytes: {exc}") from None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        close_socket(self._sock)  # wakes a thread blocked on it

    def fileno(self) -> int | None:
        return None if self._closed else self._sock.fileno()

    def recv_nowait(self, buf: memoryview) -> int:
        try:
            self._sock.settimeout(0.0)
            n = self._sock.recv_into(buf, min(len(buf), RECV_CHUNK))
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise TruncatedTransfer(f"TCP receive failed: {exc}") from None
        if n == 0 and len(buf):
            raise TruncatedTransfer("TCP peer closed the stream")
        return n

    def is_quiet(self) -> bool:
        if self._closed:
            return False
        try:
            self._sock.settimeout(0.0)  # non-blocking: a timeout would make recv wait
            self._sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True  # nothing to read, not closed
        except OSError:
            return False
        return False  # the end of the stream, or bytes nobody asked for


class TcpListener(SocketListener):
    def __init__(self, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        bound_host, bound_port = sock.getsockname()[:2]
        super().__init__(sock, f"tcp://{bound_host}:{bound_port}")

    def _channel(self, conn: socket.socket) -> Channel:
        return TcpChannel(conn)


class TcpTransport(Transport):
    name = "tcp"

    def listen(self, address: str | None = None) -> Listener:
        host, port = parse_address(address) if address else ("127.0.0.1", 0)
        return TcpListener(host, port)

    def connect(self, address: str, deadline: float) -> Channel:
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port),
                                            timeout=remaining(deadline, "TCP connect"))
        except TimeoutError:
            raise TransferTimeout(f"TCP connect to {address} passed its deadline") from None
        except OSError as exc:
            raise TransferRejected(f"cannot connect to the KV receiver at {address}: {exc}; "
                                   "is the decode worker up?") from None
        return TcpChannel(sock)


register_transport("tcp", TcpTransport)
