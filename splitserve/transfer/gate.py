"""A KV receiver's front door: accepts connections and holds them, without a thread each,
until a whole HEADER frame arrived; only then does the receiver see the channel.

    gate thread (one per receiver)                      receiver (receiver.py)
    accept: at max_connections, close the oldest
            held connection to make room
    readable: recv_nowait into the prelude, then the
              body (its size capped, and reserved from
              a shared budget, before allocating)
    HEADER complete ----------------------------------> on_header(channel, prelude, body):
                                                        authenticates it; a thread per
                                                        authenticated transfer
    park(channel): held again, idle, for the  <-------- finished(channel, keep=True)
    sender's next transfer on it

A fresh connection has `header_timeout_s` to deliver its whole header; a parked one may
stay silent for `idle_timeout_s`, then has `header_timeout_s` from its next first byte. So
a peer that connects and says nothing (or trickles a header) costs a few kilobytes and a
slot, never a thread, and a real sender, whose header follows its connect at once, is not
starved: when the slots are all taken, the oldest never-authenticated connection makes
room (then the oldest parked one; a sender's pool notices a closed idle channel).

**Memory bound** (what idle or slow peers can make a receiver hold): at most
`max_connections` (1024) connections, each under HELD_CONNECTION_BYTES (2 KiB) of our
memory (channel, socket, entry, selector key: 0.8-0.9 KB measured over TCP and shm, see
tests/transfer/test_kv_listener.py) plus kernel socket buffers, which hold only bytes a
peer actually sent; plus header bodies, at most `max_header_bytes` (2 MiB) each and
`header_budget_bytes` (32 MiB) in all. So at most 2 MiB + 32 MiB, and no thread per
connection: one gate thread, plus one thread per authenticated transfer being received
(at most one per expected import) and at most MAX_DRAINS draining refused ones
(receiver.py).

The loop never dies of an exception: a failed turn is logged and counted, and the gate
backs off and goes on. Only after MAX_FAILED_TURNS failed turns in a row (or a
BaseException) does it stop; then `failure` is set, it is logged as critical and the
receiver raises on its next poll, so the worker fails loudly instead of silently
accepting nothing. Channels without a descriptor (the in-process transport, whose peers
are in this process) are read on a thread of their own.
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.errors import BlobFormatError, KVTransferError
from splitserve.transfer.blob import (MAX_RECORD_BYTES, PRELUDE, FrameKind, Prelude,
                                      check_record_prelude, parse_prelude)
from splitserve.transfer.transport import RECEIVER_IDLE_S, Channel, Listener

logger = logging.getLogger(__name__)

HELD_CONNECTION_BYTES = 2 << 10  # the documented bound per held connection (see above)
MAX_FAILED_TURNS = 30  # in a row, backing off up to 1 s each: ~25 s of a broken loop
ACCEPT_BATCH = 64  # connections accepted per readable event, so reads are not starved
SWEEP_S = 0.1  # how often deadlines are checked
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_LISTENER, _WAKE = object(), object()

OnHeader = Callable[[Channel, Prelude, bytes], None]


@dataclass(frozen=True, slots=True)
class GateLimits:
    max_connections: int = 1024  # held by the gate + handed to the receiver
    max_header_bytes: int = MAX_RECORD_BYTES
    header_budget_bytes: int = 32 << 20  # header bodies being received, all connections
    header_timeout_s: float = 10.0
    idle_timeout_s: float = RECEIVER_IDLE_S  # a parked channel waiting for its next header

    def __post_init__(self) -> None:
        if min(self.max_connections, self.max_header_bytes, self.header_timeout_s,
               self.idle_timeout_s) <= 0 or self.header_budget_bytes < self.max_header_bytes:
            raise ValueError(f"bad KV listener limits {self}: all positive, and the header "
                             "budget at least one header")


@dataclass(frozen=True, slots=True)
class GateStats:
    held: int  # connections waiting for a header (fresh or parked)
    busy: int  # handed to the receiver
    accepted: int
    evicted: int  # closed to make room (connection cap or header budget)
    refused: int  # closed at accept (no room) or for a malformed prelude
    timed_out: int  # no header in time
    failed_turns: int  # loop turns that raised (each logged)


class _Entry:
    """A held connection and its partial header."""
    __slots__ = ("channel", "fd", "parked", "deadline", "prelude", "filled", "header",
                 "body", "body_filled", "reserved")

    def __init__(self, channel: Channel, fd: int, parked: bool, deadline: float) -> None:
        self.channel, self.fd, self.parked, self.deadline = channel, fd, parked, deadline
        self.prelude = bytearray(PRELUDE.size)
        self.filled = 0
        self.header: Prelude | None = None
        self.body: bytearray | None = None
        self.body_filled = 0
        self.reserved = 0  # bytes of the header budget this entry holds


class HeaderGate:
    def __init__(self, listener: Listener, on_header: OnHeader, limits: GateLimits) -> None:
        self.listener, self.on_header, self.limits = listener, on_header, limits
        self.failure: BaseException | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        listener_fd = listener.fileno()
        if listener_fd is not None:
            self._selector.register(listener_fd, selectors.EVENT_READ, _LISTENER)
        # Held connections by age (eviction takes the first): never-authenticated ones,
        # and parked ones (they carried a transfer).
        self._fresh: OrderedDict[int, _Entry] = OrderedDict()
        self._parked: OrderedDict[int, _Entry] = OrderedDict()
        self._parking: deque[Channel] = deque()
        self._reading: set[Channel] = set()  # without a descriptor, read on their own thread
        self._lock = threading.Lock()  # _parking, _reading, _busy (other threads touch them)
        self._busy = 0
        self._reserved = 0  # header body bytes allocated
        self._counts = dict(accepted=0, evicted=0, refused=0, timed_out=0, failed_turns=0)
        self._next_sweep = 0.0
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._guarded, args=(self._turn,),
                                          daemon=True, name="kv-gate")]
        if listener_fd is None:  # in-process listener: accept on a thread of its own
            self._threads.append(threading.Thread(
                target=self._guarded, args=(self._accept_blocking,), daemon=True,
                name="kv-accept"))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def stats(self) -> GateStats:
        with self._lock:
            busy = self._busy
        return GateStats(len(self._fresh) + len(self._parked), busy, **self._counts)

    def finished(self, channel: Channel, keep: bool) -> None:
        """The receiver is done with a channel `on_header` gave it (any thread): `keep` (in
        step, idle) parks it for the sender's next transfer, else it is closed."""
        with self._lock:  # closed is checked under the lock close() drains _parking with
            keep = keep and not self._closed.is_set()
            if keep:
                self._parking.append(channel)
            else:
                self._busy -= 1
        if keep:
            self._wake()
        else:
            channel.close()

    def close(self) -> None:
        """Stops accepting and closes every held connection (not those handed out)."""
        self._closed.set()
        self.listener.close()
        self._wake()
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout=5)
        for entry in [*self._fresh.values(), *self._parked.values()]:
            self._drop(entry)
        with self._lock:
            parking, self._parking = list(self._parking), deque()
            reading = list(self._reading)
        for channel in parking + reading:
            channel.close()  # wakes a thread reading one
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- the loop -------------------------------------------------------------------------
    def _guarded(self, turn: Callable[[], None]) -> None:
        failures = 0
        try:
            while not self._closed.is_set():
                try:
                    turn()
                    failures = 0
                except Exception:
                    failures += 1
                    self._counts["failed_turns"] += 1
                    logger.exception("KV listener: a turn failed (%d in a row); going on",
                                     failures)
                    if failures >= MAX_FAILED_TURNS:
                        raise
                    self._closed.wait(min(1.0, 0.01 * 2 ** failures))
        except BaseException as exc:
            if not self._closed.is_set():
                self.failure = exc
                logger.critical("KV listener at %s stopped: %r; this receiver takes no more "
                                "KV", self.listener.address, exc)

    def _turn(self) -> None:
        for key, _ in self._selector.select(SWEEP_S):
            if key.data is _LISTENER:
                self._accept_ready()
            elif key.data is _WAKE:
                while True:
                    try:
                        if not self._wake_r.recv(4096):
                            break
                    except BlockingIOError:
                        break
                self._take_parked()
            else:
                self._advance(key.data)
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_S
            for held in (self._fresh, self._parked):
                for entry in [e for e in held.values() if now >= e.deadline]:
                    self._counts["timed_out"] += 1
                    self._drop(entry)

    def _accept_ready(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                channel = self.listener.accept(0.0)  # a passed deadline: one try, no wait
            except OSError as exc:
                if exc.errno not in _OUT_OF_DESCRIPTORS:
                    raise
                logger.warning("KV listener: out of descriptors (%s); closing the oldest "
                               "held connection", exc)
                if not self._evict_one():
                    self._closed.wait(0.05)  # nothing to free: let handed-out ones finish
                return
            if channel is None:
                return
            self._counts["accepted"] += 1
            self._adopt(channel, parked=False)

    def _accept_blocking(self) -> None:
        channel = self.listener.accept(time.monotonic() + 0.2)
        if channel is not None:
            self._counts["accepted"] += 1
            self._adopt(channel, parked=False)

    def _take_parked(self) -> None:
        with self._lock:
            parking, self._parking = list(self._parking), deque()
            self._busy -= len(parking)
        for channel in parking:
            self._adopt(channel, parked=True)

    def _adopt(self, channel: Channel, parked: bool) -> None:
        """Holds `channel` (new, or back from a transfer) until its next header."""
        with self._lock:
            full = len(self._fresh) + len(self._parked) + self._busy >= self.limits.max_connections
        if full and not self._evict_one():
            self._counts["refused"] += 1
            channel.close()
            return
        now = time.monotonic()
        deadline = now + (self.limits.idle_timeout_s if parked else self.limits.header_timeout_s)
        fd = channel.fileno()
        if fd is None:
            with self._lock:
                self._busy += 1
                self._reading.add(channel)
            threading.Thread(target=self._read_blocking, args=(channel, deadline),
                             daemon=True, name="kv-header").start()
            return
        entry = _Entry(channel, fd, parked, deadline)
        (self._parked if parked else self._fresh)[fd] = entry
        self._selector.register(fd, selectors.EVENT_READ, entry)
        if parked:
            self._advance(entry)  # bytes may have arrived while it was away

    def _advance(self, entry: _Entry) -> None:
        """Reads what arrived of `entry`'s header; hands it over once complete."""
        held = self._parked if entry.parked else self._fresh
        if held.get(entry.fd) is not entry:
            return  # dropped earlier in this turn (its descriptor may be reused)
        try:
            while entry.body is None:
                n = entry.channel.recv_nowait(memoryview(entry.prelude)[entry.filled:])
                if n == 0:
                    return
                if entry.filled == 0 and entry.parked:  # an idle channel's next header
                    entry.deadline = time.monotonic() + self.limits.header_timeout_s
                entry.filled += n
                if entry.filled == PRELUDE.size:
                    entry.header = self._check_prelude(entry.prelude)
                    self._reserve(entry.header.size)
                    entry.reserved = entry.header.size
                    entry.body = bytearray(entry.header.size)
            while entry.body_filled < len(entry.body):
                n = entry.channel.recv_nowait(memoryview(entry.body)[entry.body_filled:])
                if n == 0:
                    return
                entry.body_filled += n
        except KVTransferError as exc:
            logger.debug("KV listener: closed a connection before its header: %s", exc)
            if isinstance(exc, BlobFormatError):
                self._counts["refused"] += 1
            self._drop(entry)
            return
        assert entry.header is not None
        self._forget(entry)
        with self._lock:
            self._busy += 1
        self._hand_over(entry.channel, entry.header, bytes(entry.body))

    def _read_blocking(self, channel: Channel, deadline: float) -> None:
        """A channel without a descriptor: its header, read on this thread."""
        try:
            prelude = bytearray(PRELUDE.size)
            channel.recv_into(memoryview(prelude), deadline)
            header = self._check_prelude(prelude)
            body = bytearray(header.size)
            channel.recv_into(memoryview(body), time.monotonic() + self.limits.header_timeout_s)
        except KVTransferError:
            self.finished(channel, keep=False)
            return
        finally:
            with self._lock:
                self._reading.discard(channel)
        self._hand_over(channel, header, bytes(body))

    def _hand_over(self, channel: Channel, header: Prelude, body: bytes) -> None:
        try:
            self.on_header(channel, header, body)
        except Exception:  # a bug in the receiver: this connection only
            logger.exception("KV receiver failed on a header; connection closed")
            self.finished(channel, keep=False)

    def _check_prelude(self, data: bytearray) -> Prelude:
        prelude = parse_prelude(data)
        check_record_prelude(prelude, FrameKind.HEADER)
        if prelude.size > self.limits.max_header_bytes:
            raise BlobFormatError(f"header of {prelude.size} bytes is over the listener's "
                                  f"cap of {self.limits.max_header_bytes}")
        return prelude

    # -- room -------------------------------------------------------------------------------
    def _reserve(self, size: int) -> None:
        """Takes `size` bytes of the header budget, closing the oldest connections that hold
        some (never-authenticated ones first) while it is short."""
        while self._reserved + size > self.limits.header_budget_bytes:
            victim = next((e for held in (self._fresh, self._parked) for e in held.values()
                           if e.reserved), None)
            if victim is None:  # cannot happen: one header always fits the budget
                raise BlobFormatError("KV listener's header budget is exhausted")
            self._counts["evicted"] += 1
            self._drop(victim)
        self._reserved += size

    def _evict_one(self) -> bool:
        """Closes the oldest held connection (never-authenticated first); False if none."""
        for held in (self._fresh, self._parked):
            if held:
                self._counts["evicted"] += 1
                self._drop(next(iter(held.values())))
                return True
        return False

    def _forget(self, entry: _Entry) -> None:
        """Stops holding `entry` (not closing it)."""
        (self._parked if entry.parked else self._fresh).pop(entry.fd, None)
        try:
            self._selector.unregister(entry.fd)
        except (KeyError, ValueError):
            pass
        self._reserved -= entry.reserved
        entry.reserved = 0

    def _drop(self, entry: _Entry) -> None:
        self._forget(entry)
        entry.channel.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # full (a wake-up is pending anyway) or closed
