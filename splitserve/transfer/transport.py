"""The one transport interface every KV transport implements, the pollable transfer state,
and the registry of transports.

A transport moves an ordered, reliable byte stream between two endpoints: the sender
`connect`s to the address a receiver's `Listener` advertises and gets a `Channel`; the
receiver `accept`s the matching `Channel`. The blob format (blob.py) frames KV on top, so
a transport knows nothing about KV. Every blocking call takes an absolute deadline on
`time.monotonic()`: nothing waits forever.

    sender thread                           receiver reader thread
    chan = transport.connect(addr, dl)      chan = listener.accept(dl)
    chan.send([prelude, K/V bytes], dl)     chan.recv_into(buf, dl)   # exactly len(buf)
    chan.recv_into(reply, dl)          <--  chan.send([reply], dl)

Errors are typed: `TransferTimeout` at a deadline, `TruncatedTransfer` when the peer closed
or died (or `close()` was called from another thread, which wakes a blocked call).
A channel carries one transfer after another: senders keep idle ones in a `ChannelPool`.
"""
from __future__ import annotations

import importlib
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from splitserve.errors import KVTransferError, TransferTimeout

Buffer = bytes | bytearray | memoryview


class TransferState(IntEnum):
    """Where a transfer is; terminal states sort last."""
    PENDING = 0  # planned or connecting; no KV bytes moved yet
    TRANSFERRING = 1
    DONE = 2  # receiver committed the KV (sender: acknowledged)
    FAILED = 3  # see TransferStatus.error; nothing was committed

    @property
    def is_terminal(self) -> bool:
        return self >= TransferState.DONE


@dataclass(frozen=True, slots=True)
class TransferStatus:
    """`Pending | Transferring | Done | Failed(reason)`: `error` is set exactly when FAILED."""
    state: TransferState
    error: KVTransferError | None = None

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal


class Channel(ABC):
    """One transfer's ordered, reliable, bidirectional byte stream.

    Each direction is used by one thread at a time; `close()` may be called from any
    thread and wakes a blocked `send`/`recv_into` with `TruncatedTransfer`.
    """

    @abstractmethod
    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        """Writes all of `parts`, in order, as one coalesced write (gathered, not joined).
        The parts may be reused by the caller once this returns."""

    @abstractmethod
    def recv_into(self, buf: memoryview, deadline: float) -> None:
        """Fills `buf` with exactly `len(buf)` bytes of the stream."""

    @abstractmethod
    def close(self) -> None:
        """Releases the channel; idempotent. The peer's next read sees the stream end."""

    def is_quiet(self) -> bool:
        """True while the peer is connected and nothing it sent is unread; never blocks.
        Asked between transfers (can an idle channel be reused?) and during one (did the
        receiver answer?). A transport that cannot tell says False: its channels are never
        reused, and its senders read the header's answer at the first layer."""
        return False

    def fileno(self) -> int | None:
        """A descriptor that polls readable when `recv_nowait` has something to do (bytes,
        a handshake, the end of the stream), or None: then a receiver reads the channel's
        header on a thread of its own (fine for peers in this process only, see gate.py)."""
        return None

    def recv_nowait(self, buf: memoryview) -> int:
        """Fills a prefix of `buf` with what already arrived, without blocking: the number
        of bytes (0: nothing yet). TruncatedTransfer once the stream ended. Only for
        channels with a `fileno`."""
        raise NotImplementedError(f"{type(self).__name__} cannot be read without blocking")


class Listener(ABC):
    """A receiver's endpoint: peers connect to `address`."""
    address: str

    @abstractmethod
    def accept(self, deadline: float) -> Channel | None:
        """The next incoming channel, or None if none arrived by `deadline` (a deadline
        already passed: one attempt that does not wait). OSError for a failure that is not
        a timeout or the listener's close (e.g. EMFILE: out of descriptors)."""

    def fileno(self) -> int | None:
        """A descriptor that polls readable when `accept` has a channel, or None."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stops accepting; idempotent. Channels already accepted stay open."""


class SocketListener(Listener):
    """A listener over a bound, listening stream socket (tcp, and shm's Unix socket):
    `accept` waits on it until the deadline and wraps the connection in `_channel`."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        sock.listen(LISTEN_BACKLOG)
        self._sock, self.address = sock, address
        self._closed = False

    @abstractmethod
    def _channel(self, conn: socket.socket) -> Channel:
        """The transport's channel over an accepted connection."""

    def accept(self, deadline: float) -> Channel | None:
        if self._closed:
            return None
        try:
            self._sock.settimeout(max(0.0, deadline - time.monotonic()))
            conn, _ = self._sock.accept()
        except (TimeoutError, BlockingIOError, ConnectionAbortedError):
            return None
        except OSError:
            if self._closed:
                return None  # closed from another thread
            raise  # EMFILE and friends: the caller must know (gate.py backs off)
        return self._channel(conn)

    def fileno(self) -> int | None:
        return None if self._closed else self._sock.fileno()

    def close(self) -> None:
        self._closed = True
        close_socket(self._sock)


class Transport(ABC):
    """A way to move bytes between engines (`inproc`, `shm`, `tcp`, ...)."""
    name: str

    @abstractmethod
    def listen(self, address: str | None = None) -> Listener:
        """Opens a receiving endpoint; `address` None picks a fresh local one."""

    @abstractmethod
    def connect(self, address: str, deadline: float) -> Channel:
        """Opens a channel to the listener at `address` (as its `address` attribute says)."""


# A sender reuses a channel idle at most this long; a receiver closes a channel idle for
# RECEIVER_IDLE_S, much longer, so a channel that passed the sender's liveness check is
# not closed under its next transfer (unless the receiver died, which the sender sees).
MAX_IDLE_S = 60.0
RECEIVER_IDLE_S = 5 * MAX_IDLE_S
# Connections the kernel completes before a listener accepts them (capped by
# net.core.somaxconn): room for a burst (say, 2,000 idle connections opened at once), so a
# real sender's handshake is not dropped and retried a second later while the gate catches up.
LISTEN_BACKLOG = 1024


class ChannelSource(Protocol):
    """Where a sender's transfer takes its channel from and gives it back to: a
    `ChannelPool`, or a wrapper around one (fault injection, faulty.py)."""

    def acquire(self, address: str, deadline: float) -> tuple[Channel, bool]:
        """A channel to `address`, and whether it is a reused one."""

    def release(self, address: str, channel: Channel) -> None:
        """Takes back `channel`, whose last transfer ended cleanly (else it is closed)."""


class ChannelPool(ChannelSource):
    """Idle channels kept open between transfers, by address, so that a transfer does not
    pay a connection, a handshake and fresh (page-faulting) buffers every time.

    A channel goes back (`release`) only after a transfer ended cleanly on it, so its
    stream is at a frame boundary on both ends; anything else closes it. `acquire` checks
    an idle channel without blocking (`Channel.is_quiet`) before handing it out: a
    receiver that closed it (restarted, or idle too long) is noticed there.
    """

    def __init__(self, max_idle_per_address: int = 4, max_idle_s: float = MAX_IDLE_S) -> None:
        self.max_idle_per_address, self.max_idle_s = max_idle_per_address, max_idle_s
        self._idle: dict[str, list[tuple[float, Channel]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, address: str, deadline: float) -> tuple[Channel, bool]:
        while True:
            with self._lock:
                idle = self._idle.get(address)
                since, channel = idle.pop() if idle else (0.0, None)
            if channel is None:
                return get_transport(scheme(address)).connect(address, deadline), False
            if time.monotonic() - since < self.max_idle_s and channel.is_quiet():
                return channel, True
            channel.close()

    def release(self, address: str, channel: Channel) -> None:
        """Keeps `channel` for the next transfer (up to `max_idle_per_address`)."""
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < self.max_idle_per_address:
                idle.append((time.monotonic(), channel))
                return
        channel.close()

    def close(self) -> None:
        """Closes every idle channel; channels released later are closed at once."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, channel in entries:
                channel.close()


def remaining(deadline: float, what: str) -> float:
    """Seconds left before `deadline`; TransferTimeout naming `what` if none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what} passed its deadline; raise the transfer timeout or "
                              "check that the peer is alive and not overloaded")
    return left


def scheme(address: str) -> str:
    """The transport name of an address: `tcp://127.0.0.1:5000` -> `tcp`."""
    name, sep, _ = address.partition("://")
    if not sep:
        raise ValueError(f"KV transfer address {address!r} has no scheme; expected e.g. "
                         f"'tcp://host:port' (supported: {supported_transports()})")
    return name


# -- registry -------------------------------------------------------------------------------
# Built-in transports are imported on first use, so `import splitserve.transfer.transport`
# stays light (no torch) for processes that only move bytes.
_BUILTIN = {
    "inproc": "splitserve.transfer.inproc",
    "shm": "splitserve.transfer.shm",
    "tcp": "splitserve.transfer.tcp",
}
_FACTORIES: dict[str, Callable[[], Transport]] = {}
_INSTANCES: dict[str, Transport] = {}


def register_transport(name: str, factory: Callable[[], Transport]) -> None:
    """Makes `get_transport(name)` build transports with `factory` (RDMA, Mooncake, ...)."""
    _FACTORIES[name] = factory
    _INSTANCES.pop(name, None)


def supported_transports() -> list[str]:
    return sorted({*_BUILTIN, *_FACTORIES})


def get_transport(name: str) -> Transport:
    """The process-wide transport called `name`; KeyError listing the supported names."""
    if name not in _INSTANCES:
        if name not in _FACTORIES and name in _BUILTIN:
            importlib.import_module(_BUILTIN[name])  # registers itself
        factory = _FACTORIES.get(name)
        if factory is None:
            raise KeyError(f"unknown KV transport {name!r}; supported: {supported_transports()}")
        _INSTANCES[name] = factory()
    return _INSTANCES[name]


def close_socket(sock: socket.socket) -> None:
    """Shuts a socket down (waking any thread blocked on it) and closes it; never raises."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected, or already shut
    sock.close()
