"""Same-host shared-memory transport: bulk bytes through a ring in shared memory, doorbells
and credits through a Unix socket.

    connector                                      acceptor
    memfd ring A (4 MiB)   ==== bytes ====>        mmap of ring A
    mmap of ring B         <=== replies ====       (ring B, 1 MiB, made by the connector)
    Unix socket            <--- DATA(total written) / CREDIT(total read) --->

The connector creates both rings with `memfd_create` and passes their descriptors over the
Unix socket (SCM_RIGHTS): no names in /dev/shm to leak, and the memory goes away with the
last process that maps it. It seals each ring's size once set (F_SEAL_SHRINK | GROW |
SEAL), and the acceptor maps only sealed memfds of the announced, bounded size: a peer
that could shrink a ring under the reader would crash it with SIGBUS at the next copy.
Who may connect at all is the socket's file permissions: by default it lives in a private
(0700) directory, so only processes of the same user reach it. Each side copies its bytes
into its outgoing ring and posts `DATA(n)` (cumulative bytes written); the reader copies
out and posts `CREDIT(n)` (cumulative bytes read); a writer blocks while the ring is full.
Counters are cumulative, so messages are idempotent and need no acknowledgement. Doorbells
are batched, since each is a system call (~8 us here) and a wake-up: DATA goes out every
CHUNK bytes and at the end of each `send`, CREDIT every quarter ring; and both go out
before a side blocks, so a writer waiting for space and a reader waiting for bytes can
never wait on each other. The socket doubles as the liveness signal: a peer that dies
closes it, and the other side sees the stream end at once.
Addresses are `shm://<path of the Unix socket>`.

A channel keeps its rings for life, and a sender keeps channels open between transfers
(transport.ChannelPool): first-touch page faults made a fresh ring ~14x slower than memcpy
on the machines we measured (docs/benchmarks.md), so only a channel's first transfer pays
them.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Sequence

from splitserve.errors import (BlobFormatError, TransferRejected, TransferTimeout,
                               TruncatedTransfer)
from splitserve.transfer.transport import (Buffer, Channel, Listener, SocketListener,
                                           Transport, close_socket, register_transport,
                                           remaining)

DATA_RING_BYTES = 4 << 20  # connector -> acceptor (the KV direction); stays in cache
REPLY_RING_BYTES = 1 << 20  # acceptor -> connector (replies)
# Post a DATA doorbell every CHUNK bytes so the reader copies out while the writer copies in.
CHUNK = 256 << 10
# A side that waits for a doorbell polls the socket a while before it sleeps: waking a
# sleeping process costs the waker 10-50 us and the sleeper 0.1-1.5 ms on a VM (measured on
# ours), and the peer of a transfer in flight usually answers sooner. Every wait of the
# connector (the KV sender) is inside a transfer (ring space, the answer to what it sent),
# so it polls longer, and the receiver, the slower side, never pays to wake it; the acceptor
# also waits for the next transfer, which may be far off, so it sleeps sooner.
CONNECTOR_SPIN_S = 1e-3
ACCEPTOR_SPIN_S = 200e-6
# Ring sizes an acceptor maps (an empty ring breaks the ring arithmetic; a huge one is
# address space a peer should not make us pin).
MIN_RING_BYTES, MAX_RING_BYTES = mmap.PAGESIZE, 256 << 20
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_HELLO = struct.Struct("<4sQQ")  # magic, connector->acceptor ring bytes, reverse ring bytes
_HELLO_MAGIC = b"SSHM"
_CTL = struct.Struct("<BQ")  # kind, cumulative byte count
_DATA, _CREDIT = 1, 2


class ShmChannel(Channel):
    def __init__(self, sock: socket.socket,
                 rings: tuple[mmap.mmap, mmap.mmap] | None = None) -> None:
        self._sock = sock
        self._spin_s = CONNECTOR_SPIN_S if rings is not None else ACCEPTOR_SPIN_S
        self._closed = False
        self._close_lock = threading.Lock()
        self._ctl_buf = bytearray()
        self._peer_gone = False
        self._written = self._credited = 0  # my outgoing ring
        self._available = self._consumed = 0  # the peer's ring (my incoming)
        self._told_written = self._told_consumed = 0  # what the last DATA / CREDIT said
        self._out: memoryview | None = None
        self._in: memoryview | None = None
        if rings is not None:  # connector: (data, reply); the acceptor maps them on first use
            self._out, self._in = memoryview(rings[0]), memoryview(rings[1])

    def _handshake(self, deadline: float | None) -> bool:
        """Acceptor side: receive the rings' descriptors (lazily, on first use, so `accept`
        never waits on a slow peer). `deadline` None: only if they already arrived (False
        if not)."""
        try:
            self._sock.settimeout(0.0 if deadline is None
                                  else remaining(deadline, "shared-memory handshake"))
            msg, fds, _, _ = socket.recv_fds(self._sock, _HELLO.size, 2)
        except BlockingIOError:
            return False
        except TimeoutError:
            raise TransferTimeout("shared-memory handshake passed its deadline") from None
        except OSError as exc:
            raise TruncatedTransfer(f"shared-memory handshake failed: {exc}") from None
        try:
            if not msg:
                raise TruncatedTransfer("shared-memory peer closed before its handshake")
            if len(msg) != _HELLO.size or len(fds) != 2:
                raise BlobFormatError("bad shared-memory handshake (not a splitserve peer?)")
            magic, to_me, to_peer = _HELLO.unpack(msg)
            if magic != _HELLO_MAGIC:
                raise BlobFormatError("bad shared-memory handshake magic")
            self._in, self._out = _map(fds[0], to_me), _map(fds[1], to_peer)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    # -- byte stream ------------------------------------------------------------------------
    def send(self, parts: Sequence[Buffer], deadline: float) -> None:
        if self._out is None:
            self._handshake(deadline)
        assert self._out is not None
        size = len(self._out)
        for part in parts:
            src = memoryview(part).cast("B")
            off = 0
            while off < len(src):
                free = size - (self._written - self._credited)
                if free == 0 or self._peer_gone:
                    self._pump(deadline, "shared-memory send (ring full)")
                    continue
                n = min(free, len(src) - off, CHUNK)
                pos = self._written % size
                first = min(n, size - pos)  # up to the end of the ring, then wrap
                self._out[pos:pos + first] = src[off:off + first]
                if n > first:
                    self._out[:n - first] = src[off + first:off + n]
                self._written += n
                off += n
                if self._written - self._told_written >= CHUNK:
                    self._tell_written()
        self._tell_written()

    def recv_into(self, buf: memoryview, deadline: float) -> None:
        if self._in is None:
            self._handshake(deadline)
        buf = buf.cast("B") if buf.format != "B" else buf
        filled = 0
        while filled < len(buf):
            if self._available == self._consumed:
                if self._peer_gone:
                    raise TruncatedTransfer(f"shared-memory peer closed the stream after "
                                            f"{filled} of {len(buf)} bytes of a frame")
                self._pump(deadline, "shared-memory receive")
                continue
            filled += self._copy_out(buf[filled:])

    def fileno(self) -> int | None:
        return None if self._closed else self._sock.fileno()

    def recv_nowait(self, buf: memoryview) -> int:
        if self._in is None and not self._handshake(None):
            return 0
        if self._available == self._consumed and not self._peer_gone:
            try:  # doorbells that already arrived
                self._sock.settimeout(0.0)
                while data := self._sock.recv(4096):
                    self._apply(data)
                self._peer_gone = True
            except BlockingIOError:
                pass
            except OSError:
                self._peer_gone = True
        if self._available == self._consumed:
            if self._peer_gone:
                raise TruncatedTransfer("shared-memory peer closed the stream")
            return 0
        return self._copy_out(buf)

    def _copy_out(self, buf: memoryview) -> int:
        """Copies what the ring holds (up to len(buf)) into buf: the count."""
        assert self._in is not None
        size = len(self._in)
        n = min(self._available - self._consumed, len(buf))
        pos = self._consumed % size
        first = min(n, size - pos)
        buf[:first] = self._in[pos:pos + first]
        if n > first:
            buf[first:n] = self._in[:n - first]
        self._consumed += n
        if self._consumed - self._told_consumed >= size // 4:
            self._tell_consumed()
        return n

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        close_socket(self._sock)  # wakes a thread blocked on it
        # Mappings are not closed here: another thread may still be copying out of one;
        # they go with their last view.

    def is_quiet(self) -> bool:
        if self._closed or self._peer_gone:
            return False
        try:
            self._sock.settimeout(0.0)  # non-blocking: a timeout would make recv wait
            while data := self._sock.recv(4096):  # doorbells (a last CREDIT) may precede
                self._apply(data)                  # the end of the stream: read them all
        except BlockingIOError:
            return self._available == self._consumed  # nothing unread, not closed
        except OSError:
            return False
        self._peer_gone = True
        return False

    # -- control messages -------------------------------------------------------------------
    def _tell_written(self) -> None:
        if self._written != self._told_written:
            self._told_written = self._written
            self._post(_DATA, self._written)

    def _tell_consumed(self) -> None:
        if self._consumed != self._told_consumed:
            self._told_consumed = self._consumed
            self._post(_CREDIT, self._consumed)

    def _post(self, kind: int, total: int) -> None:
        try:
            self._sock.sendall(_CTL.pack(kind, total))
        except OSError as exc:
            # The peer closed. Do not mark it gone yet: what it sent before closing (a
            # reply saying why) is still queued on the socket for _pump to read.
            if kind == _DATA:
                raise TruncatedTransfer(f"shared-memory peer closed the channel: {exc}") from None

    def _pump(self, deadline: float, what: str) -> None:
        """Waits for control messages and applies them (DATA and CREDIT alike), after telling
        the peer everything it may be waiting for."""
        if self._peer_gone:
            raise TruncatedTransfer(f"{what}: the peer closed the channel")
        self._tell_written()
        self._tell_consumed()
        try:
            data = self._poll(deadline, what)
        except TimeoutError:
            raise TransferTimeout(f"{what} passed its deadline") from None
        except OSError:  # reset (the peer closed with our messages unread) or closed here
            data = b""
        if not data:
            self._peer_gone = True
            return
        self._apply(data)

    def _poll(self, deadline: float, what: str) -> bytes:
        """The next control bytes: polled for a while (see CONNECTOR_SPIN_S), then waited
        for."""
        self._sock.settimeout(0.0)
        spin_end = time.perf_counter() + self._spin_s
        while True:
            try:
                return self._sock.recv(4096)
            except BlockingIOError:
                if time.perf_counter() > spin_end:
                    break
        self._sock.settimeout(remaining(deadline, what))
        return self._sock.recv(4096)

    def _apply(self, data: bytes) -> None:
        self._ctl_buf += data
        whole = len(self._ctl_buf) - len(self._ctl_buf) % _CTL.size
        for kind, total in _CTL.iter_unpack(bytes(self._ctl_buf[:whole])):
            # A peer that claims more than it wrote, or credits what it was never sent,
            # breaks the ring's arithmetic (a copy past the ring's end): refused.
            if kind == _DATA and total - self._consumed <= len(self._in or b""):
                self._available = max(self._available, total)
            elif kind == _CREDIT and total <= self._written:
                self._credited = max(self._credited, total)
            elif kind in (_DATA, _CREDIT):
                raise BlobFormatError(f"shared-memory peer announced {total} bytes, beyond "
                                      "what its ring can hold")
            else:
                raise BlobFormatError(f"unknown shared-memory control message {kind}")
        del self._ctl_buf[:whole]


class ShmListener(SocketListener):
    def __init__(self, path: str | None) -> None:
        self._dir = None if path else tempfile.mkdtemp(prefix="splitserve-shm-")
        self._path = path or os.path.join(self._dir or "", "kv.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self._path)
        super().__init__(sock, f"shm://{self._path}")

    def _channel(self, conn: socket.socket) -> Channel:
        return ShmChannel(conn)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            try:
                os.unlink(self._path)
            except OSError:
                pass


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, data_ring_bytes: int = DATA_RING_BYTES,
                 reply_ring_bytes: int = REPLY_RING_BYTES) -> None:
        self.data_ring_bytes, self.reply_ring_bytes = data_ring_bytes, reply_ring_bytes

    def listen(self, address: str | None = None) -> Listener:
        return ShmListener(address.removeprefix("shm://") if address else None)

    def connect(self, address: str, deadline: float) -> Channel:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(remaining(deadline, "shared-memory connect"))
            sock.connect(address.removeprefix("shm://"))
        except TimeoutError:
            sock.close()
            raise TransferTimeout(f"shared-memory connect to {address}: deadline passed") from None
        except OSError as exc:
            sock.close()
            raise TransferRejected(f"cannot connect to the KV receiver at {address}: {exc}; "
                                   "is the decode worker up on this host?") from None
        fds: list[int] = []
        try:
            for name, size in (("data", self.data_ring_bytes), ("reply", self.reply_ring_bytes)):
                fds.append(new_ring(f"splitserve-kv-{name}", size))
            rings = (mmap.mmap(fds[0], self.data_ring_bytes),
                     mmap.mmap(fds[1], self.reply_ring_bytes))
            socket.send_fds(sock, [_HELLO.pack(_HELLO_MAGIC, self.data_ring_bytes,
                                               self.reply_ring_bytes)], fds)
        except OSError as exc:
            sock.close()
            raise TransferRejected(f"shared-memory handshake with {address}: {exc}") from None
        finally:
            for fd in fds:
                os.close(fd)  # the mappings (ours, then the acceptor's) keep the memory
        return ShmChannel(sock, rings)


def new_ring(name: str, size: int) -> int:
    """Connector: a memfd of `size` bytes whose size is sealed (it can never shrink or
    grow, and the seals cannot be lifted)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def _map(fd: int, size: int) -> memoryview:
    """Acceptor: a view of the memfd `fd`, which must be sealed and have `size` bytes."""
    if not MIN_RING_BYTES <= size <= MAX_RING_BYTES:
        raise BlobFormatError(f"shared-memory ring of {size} bytes is outside "
                              f"[{MIN_RING_BYTES}, {MAX_RING_BYTES}]")
    info = os.fstat(fd)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # not a memfd (a pipe, a file elsewhere): no seals to check
        seals = 0
    if not stat.S_ISREG(info.st_mode) or seals & _SEALS != _SEALS:
        raise BlobFormatError("shared-memory ring is not a sealed memfd: its size could "
                              "change under the reader; refused")
    if info.st_size != size:
        raise BlobFormatError(f"shared-memory ring has {info.st_size} bytes, the handshake "
                              f"said {size}")
    return memoryview(mmap.mmap(fd, size))


register_transport("shm", ShmTransport)
