"""A flag that transfer threads raise and an engine thread can sleep on beside its
control socket.

The engine thread of a worker sleeps in one poll on its frontend socket; a transfer's
threads (a verified layer, a trailer, an error, a reply) must wake it too, or it has to
turn its loop every few ms while KV is in flight. `Wakeup` is a threading.Event whose
state is also a readable file descriptor (one end of a socket pair), so `zmq.Poller` (or
`select`) can wait on it together with the socket.
"""
from __future__ import annotations

import select
import socket
import threading


class Wakeup:
    """`set()` from any thread; the waiting thread polls `fileno()` for readability (or
    calls `wait`) and calls `clear()` before it looks at what changed, so a `set` that
    comes while it looks wakes it again. Safe to `set` after `close` (nothing happens)."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._lock = threading.Lock()  # the flag and the byte in the pair change together
        self._set = False
        self._closed = False

    def fileno(self) -> int:
        return self._reader.fileno()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            if self._set or self._closed:
                return
            self._set = True
            self._writer.send(b"\0")  # one byte at most is ever unread: never blocks

    def clear(self) -> None:
        with self._lock:
            if not self._set or self._closed:
                return
            self._set = False
            self._reader.recv(1)

    def wait(self, timeout_s: float) -> bool:
        """Blocks until set or `timeout_s` passed; whether it is set."""
        if not self._set:
            select.select([self._reader], [], [], max(0.0, timeout_s))
        return self._set

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reader.close()
            self._writer.close()
