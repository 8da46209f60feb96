"""In-process transport: two bounded byte pipes between threads of one process.

For unit tests and single-process setups (DESIGN.md 4.3): it has the same semantics as the
real transports (ordered bytes, back-pressure, deadlines, end-of-stream on close), so code
tested over it behaves the same over TCP. Addresses are `inproc://<name>`.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence

from splitserve.errors import TransferRejected, TransferTimeout, TruncatedTransfer
from splitserve.transfer.transport import (Buffer, Channel, Listener, Transport,
                                           register_transport)

# Bytes a writer may queue before it blocks (then at most one more part).
PIPE_CAPACITY = 32 << 20


class _Pipe:
    """One direction of a channel: a bounded FIFO of byte chunks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._chunks: deque[memoryview] = deque()
        self._size = 0
        self._writer_closed = False  # no more data will come: reads drain, then end
        self._reader_closed = False  # nobody reads: writes and reads fail at once
        self._cond = threading.Condition()

    def write(self, parts: Sequence[Buffer], deadline: float) -> None:
        for part in parts:
            data = memoryview(bytes(part))  # a copy: the caller may reuse its buffer
            with self._cond:
                while self._size and self._size + len(data) > self.capacity:
                    self._check_writable()
                    self._wait(deadline, "in-process send")
                self._check_writable()
                self._chunks.append(data)
                self._size += len(data)
                self._cond.notify_all()

    def read_into(self, buf: memoryview, deadline: float) -> None:
        filled = 0
        with self._cond:
            while filled < len(buf):
                if self._reader_closed:
                    raise TruncatedTransfer("in-process channel was closed")
                if not self._chunks:
                    if self._writer_closed:
                        raise TruncatedTransfer(
                            f"in-process stream ended after {filled} of {len(buf)} bytes")
                    self._wait(deadline, "in-process receive")
                    continue
                head = self._chunks[0]
                n = min(len(head), len(buf) - filled)
                buf[filled:filled + n] = head[:n]
                filled += n
                self._size -= n
                if n == len(head):
                    self._chunks.popleft()
                else:
                    self._chunks[0] = head[n:]
                self._cond.notify_all()

    def is_quiet(self) -> bool:
        with self._cond:
            return not (self._chunks or self._writer_closed or self._reader_closed)

    def close_writer(self) -> None:
        with self._cond:
            self._writer_closed = True
            self._cond.notify_all()

    def close_reader(self) -> None:
        with self._cond:
            self._reader_closed = True
            self._chunks.clear()
            self._size = 0
            self._cond.notify_all()

    def _check_writable(self) -> None:
        if self._reader_closed or self._writer_closed:
            raise TruncatedTransfer("in-process channel was closed by its peer")

    def _wait(self, deadline: float, what: str) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what} passed its deadline")
        self._cond.wait(left)


class InProcChannel(Channel):
    def __init__(self, outgoing: _Pipe, incoming: _Pipe) -> None:
        self._out, self._in = outgoing, incoming

    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        self._out.write(parts, deadline)

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        self._in.read_into(buf, deadline)

    def close(self) -> None:
        self._out.close_writer()
        self._in.close_reader()

    def is_quiet(self) -> bool:
        return self._in.is_quiet() and self._out.is_quiet()


class InProcListener(Listener):
    def __init__(self, transport: InProcTransport, name: str) -> None:
        self.address = f"inproc://{name}"
        self._transport, self._name = transport, name
        self._pending: deque[InProcChannel] = deque()
        self._closed = False
        self._cond = threading.Condition()

    def accept(self, deadline: float) -> Channel | None:
        with self._cond:
            while not self._pending:
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    return None
                self._cond.wait(left)
            return self._pending.popleft()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._transport._unbind(self._name, self)

    def _offer(self, channel: InProcChannel) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._pending.append(channel)
            self._cond.notify_all()
            return True


class InProcTransport(Transport):
    name = "inproc"

    def __init__(self, capacity: int = PIPE_CAPACITY) -> None:
        self.capacity = capacity
        self._listeners: dict[str, InProcListener] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def listen(self, address: str | None = None) -> Listener:
        name = address.removeprefix("inproc://") if address else f"kv-{next(self._ids)}"
        with self._lock:
            if name in self._listeners:
                raise ValueError(f"in-process address inproc://{name} is already in use")
            listener = self._listeners[name] = InProcListener(self, name)
        return listener

    def connect(self, address: str, deadline: float) -> Channel:
        with self._lock:
            listener = self._listeners.get(address.removeprefix("inproc://"))
        to_peer, from_peer = _Pipe(self.capacity), _Pipe(self.capacity)
        if listener is None or not listener._offer(InProcChannel(from_peer, to_peer)):
            raise TransferRejected(f"no in-process KV listener at {address}; is the "
                                   "receiver running in this process?")
        return InProcChannel(to_peer, from_peer)

    def _unbind(self, name: str, listener: InProcListener) -> None:
        with self._lock:
            if self._listeners.get(name) is listener:
                del self._listeners[name]


register_transport("inproc", InProcTransport)
