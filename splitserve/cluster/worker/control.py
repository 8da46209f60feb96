"""The worker's end of the control plane: one DEALER, a CURVE client of the frontend.

The worker's key (auth.WorkerSecret, handed over by its runtime) proves who it is; the
frontend's public key proves whom it talks to, so only the frontend can send it messages.
Still, nothing that arrives can end the engine thread: every frame is checked
(`receive` returns the messages that decode and drops the rest), and a frame over
MAX_MESSAGE_BYTES is refused by ZeroMQ itself.

Sends wait at most `send_timeout_s` (SNDTIMEO): with the frontend gone or not reading,
ZeroMQ queues up to the high-water mark and then a send times out; `send` says so and
the worker exits rather than block its engine thread forever.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import zmq

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import MAX_MESSAGE_BYTES, WorkerSecret

logger = logging.getLogger(__name__)


class FrontendSocket:
    def __init__(self, address: str, identity: bytes, secret: WorkerSecret,
                 send_timeout_s: float, send_hwm: int = 1000) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.SNDTIMEO, max(1, int(send_timeout_s * 1000)))
        self.sock.setsockopt(zmq.SNDHWM, send_hwm)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        secret.connect(self.sock)
        self.sock.connect(address)
        self.num_dropped = 0  # frames that were not a message
        self._poller_fds: tuple[int, ...] = ()
        self._poll = zmq.Poller()

    def receive(self, timeout_s: float, wake_fds: Sequence[int] = ()) -> list[P.Message]:
        """Every message pending, waiting up to `timeout_s` for the first or for one of
        `wake_fds` (transfer.wakeup.Wakeup) to become readable."""
        if timeout_s > 0 and wake_fds:
            if self.sock not in dict(self._poller(tuple(wake_fds)).poll(int(timeout_s * 1000))):
                return []
        elif not self.sock.poll(int(timeout_s * 1000)):
            return []
        out: list[P.Message] = []
        # Read while ZeroMQ says a frame waits: asked, not learnt from recv's Again (an
        # exception raised and caught every turn, on the way to each request's step).
        while cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                if len(frames) != 1:
                    raise ValueError(f"{len(frames)} frames, not one")
                out.append(P.decode(frames[0]))
            except Exception as exc:  # any bytes at all: drop them, keep the engine going
                self.num_dropped += 1
                logger.warning("dropped a frame from the frontend: %s: %s",
                               type(exc).__name__, str(exc)[:300])
        return out

    def _poller(self, wake_fds: tuple[int, ...]) -> zmq.Poller:
        """The poller over the socket and `wake_fds`, made again only when they change."""
        if wake_fds != self._poller_fds:
            self._poller_fds, self._poll = wake_fds, zmq.Poller()
            self._poll.register(self.sock, zmq.POLLIN)
            for fd in wake_fds:
                self._poll.register(fd, zmq.POLLIN)
        return self._poll

    def send(self, msg: P.Message) -> bool:
        """False when the frontend did not take it within the send timeout (gone)."""
        try:
            self.sock.send(P.encode(msg), copy=False)
        except zmq.Again:
            return False
        return True

    def close(self, linger_ms: int | None = None) -> None:
        self.sock.close(linger=linger_ms)
        self.ctx.term()
