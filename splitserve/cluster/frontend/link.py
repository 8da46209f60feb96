"""The frontend's socket to its workers: one ZeroMQ ROUTER, a CURVE server (auth.py),
frames encoded by protocol.py.

    connection   CURVE handshake; the ZAP handler lets in registered keys only, under the
                 identity each was registered for          refused: counted (monitor)
    frame        exactly [routing id, message]; its User-Id (that identity) equals its
                 routing id; it decodes, nested fields included
                                                           else: dropped and counted
    message      on_message(identity, msg); ProtocolError from it means refused (counted);
                 any other exception is a bug: logged, counted, the loop goes on

Nothing a peer sends can end the receive loop. Sends never block the event loop: a send
ZeroMQ does not take (the worker's queue is at its high-water mark, or it is not
connected) is counted and handed to `on_lost` on a later turn of the loop (never inside
`send`, so the dispatcher is not re-entered), which fails or resends it (delivery.py).

The socket is a plain (blocking-API) one read from the event loop's own reader callback:
every wake-up takes the frames waiting (up to DRAIN_BATCH, and up to the first that
carries outputs, then the rest on the next turn), each handled in that callback. pyzmq's
asyncio socket would make a future, a loop turn and a dozen Python calls of its own per
frame (a fifth of a streaming frontend's CPU, measured). ZeroMQ's descriptor is
edge-triggered: it signals a change, not that frames wait, and a send can consume the
signal; so every wake-up reads until ZeroMQ has nothing (or schedules the next turn's
read), and every send is followed by one more read on the next turn.
"""
from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from splitserve.cluster import protocol as P
from splitserve.cluster.auth import (MAX_MESSAGE_BYTES, ControlAuthenticator, KeyRing,
                                     ServerKeys, WorkerSecret)
from splitserve.cluster.frontend.metrics import DropReason, LostReason, Metrics
from splitserve.errors import ProtocolError

logger = logging.getLogger(__name__)

# Messages queued per worker before a send to it is lost (ZeroMQ's default): a worker
# this far behind, with its own receive queue and the TCP buffers full too, is stuck.
SEND_HWM = 1000
# Frames handled per turn of the event loop before the other tasks get theirs.
DRAIN_BATCH = 64
_OUTPUTS = (P.Output, P.OutputBatch)  # a drain's turn ends after one of these

_HANDSHAKE_EVENTS: dict[int, DropReason] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: DropReason.HANDSHAKE,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: DropReason.HANDSHAKE,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: DropReason.UNKNOWN_KEY}


@dataclass(frozen=True, slots=True)
class LostSend:
    """A message ZeroMQ did not take; `num_resends` counts the resends before this one."""
    identity: bytes
    msg: P.Message
    reason: LostReason
    num_resends: int


class WorkerLink:
    def __init__(self, metrics: Metrics, host: str = "127.0.0.1") -> None:
        self.metrics = metrics
        self.on_lost: Callable[[LostSend], None] | None = None
        self.keys = KeyRing()
        self.store_key = b""  # handed to every worker it enrolls (WorkerSecret.store_key)
        self._server = ServerKeys.generate()
        self.ctx = zmq.asyncio.Context()
        # NOTE: the ZAP handler must be up before the socket binds; without one, libzmq
        # lets every CURVE client in.
        self._auth = ControlAuthenticator(zmq.Context.shadow(self.ctx.underlying), self.keys)
        self._auth.start()
        self.sock: zmq.Socket[bytes] = zmq.Context.shadow(self.ctx.underlying).socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, SEND_HWM)  # NOTE: options are fixed at bind
        self._server.serve(self.sock)
        monitor = f"inproc://splitserve-link-monitor-{id(self)}"
        self.sock.monitor(monitor, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                          | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self._monitor = self.ctx.socket(zmq.PAIR)  # an asyncio socket: awaited in the loop
        self._monitor.connect(monitor)
        # Port 0 (`*`): the kernel picks a free one at bind time, so no collision with
        # another process; the address published is the one bound.
        self.sock.bind(f"tcp://{host}:*")
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._num_logged: dict[DropReason, int] = {}
        self._on_message: Callable[[bytes, P.Message], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_due = False

    @property
    def server_public_key(self) -> bytes:
        return self._server.public

    # -- who may connect ------------------------------------------------------------------------
    def enroll(self, identity: bytes) -> WorkerSecret:
        """A fresh keypair for one worker incarnation, registered as `identity`."""
        secret = WorkerSecret.generate(self._server.public, self.store_key)
        self.allow(identity, secret.client_public)
        return secret

    def allow(self, identity: bytes, public_key: bytes) -> None:
        self.keys.allow(identity, public_key)

    def revoke(self, identity: bytes) -> None:
        self.keys.revoke(identity)

    def is_allowed(self, identity: bytes) -> bool:
        return self.keys.is_allowed(identity)

    # -- receiving ------------------------------------------------------------------------------
    async def receive(self, on_message: Callable[[bytes, P.Message], None]) -> None:
        """Runs until cancelled: each well-formed frame from the worker its key belongs to
        goes to on_message(identity, msg); everything else is dropped and counted."""
        watch = asyncio.create_task(self._watch_handshakes(), name="link-handshakes")
        self._loop = loop = asyncio.get_running_loop()
        self._on_message = on_message
        fd = self.sock.fileno()
        loop.add_reader(fd, self._drain)
        self._schedule_drain()  # frames that came before the reader was added
        try:
            await loop.create_future()  # the reader does the work, until cancelled
        finally:
            loop.remove_reader(fd)
            self._on_message = None
            watch.cancel()

    def _schedule_drain(self) -> None:
        if not self._drain_due and self._loop is not None:
            self._drain_due = True
            self._loop.call_soon(self._drain)

    def _drain(self) -> None:
        """Handles the frames waiting, DRAIN_BATCH at most, and up to the first that
        carries outputs: the rest on the next turn, after the streams those outputs woke
        have written to their clients. A step's outputs come with the worker's
        bookkeeping behind them (KV events, a load report: ~0.3 ms to handle), which
        would otherwise delay every client of that step."""
        self._drain_due = False
        for _ in range(DRAIN_BATCH):
            if self._on_message is None or self.sock.closed:
                return
            # nothing waiting: asked, not learnt from recv's Again (an exception raised and
            # caught after every drained output frame was ~5% of the frontend's CPU a token)
            if not cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if isinstance(self._handle(frames, self._on_message), _OUTPUTS):
                break
        self._schedule_drain()

    def _handle(self, frames: list[zmq.Frame],
                on_message: Callable[[bytes, P.Message], None]) -> P.Message | None:
        """The message handled (refused by its handler included); None if dropped."""
        checked = self._check(frames)
        if checked is None:
            return None
        identity, msg = checked
        try:
            on_message(identity, msg)
        except ProtocolError as exc:
            self._drop(DropReason.REFUSED, identity, str(exc))
        except Exception:  # one bad message must not stop the frontend
            self.metrics.control_dropped.labels(DropReason.HANDLER_ERROR.value).inc()
            logger.exception("failed to handle %s from %r", type(msg).__name__, identity)
        return msg

    def _check(self, frames: list[zmq.Frame]) -> tuple[bytes, P.Message] | None:
        """(identity, message) of a frame that passes every check; None when dropped."""
        identity = frames[0].bytes
        for frame in frames:
            try:
                user_id = frame.get("User-Id")
            except zmq.ZMQError:
                user_id = None
            if not isinstance(user_id, str) or user_id.encode() != identity:
                self._drop(DropReason.IDENTITY_MISMATCH, identity,
                           f"its key is registered as {user_id!r}")
                return None
        if len(frames) != 2:
            self._drop(DropReason.FRAME_COUNT, identity, f"{len(frames) - 1} message frames")
            return None
        try:
            return identity, P.decode(frames[1].bytes)
        except ProtocolError as exc:
            self._drop(DropReason.UNDECODABLE, identity, str(exc))
        except Exception as exc:  # decode should raise nothing else; never trust that
            self._drop(DropReason.UNDECODABLE, identity, f"{type(exc).__name__}: {exc}")
        return None

    async def _watch_handshakes(self) -> None:
        """Counts refused connections (handshake and ZAP failures) from socket events."""
        while True:
            event = await recv_monitor_message(self._monitor)
            reason = _HANDSHAKE_EVENTS.get(event["event"])
            if reason is not None:
                self._drop(reason, event["endpoint"], f"handshake failed ({event['value']})")

    def _drop(self, reason: DropReason, peer: bytes, why: str) -> None:
        self.metrics.control_dropped.labels(reason.value).inc()
        # The first of each reason, then one in a thousand: a flood must not flood the log.
        n = self._num_logged.get(reason, 0)
        self._num_logged[reason] = n + 1
        if n % 1000 == 0:
            logger.warning("dropped a control frame from %r (%s; %d so far): %s", peer[:64],
                           reason.value, n + 1, why[:300])

    # -- sending --------------------------------------------------------------------------------
    def send(self, identity: bytes, msg: P.Message, num_resends: int = 0) -> None:
        """Queues `msg` for the worker without blocking; `on_lost` hears if it is lost."""
        try:
            self.sock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._lost(identity, msg, num_resends, exc)
        self._schedule_drain()  # the send may have taken the descriptor's signal

    def _lost(self, identity: bytes, msg: P.Message, num_resends: int,
              exc: BaseException) -> None:
        code = getattr(exc, "errno", None)
        reason = (LostReason.FULL if code == errno.EAGAIN
                  else LostReason.UNREACHABLE if code == errno.EHOSTUNREACH
                  else LostReason.ERROR)
        kind = type(msg).__name__
        self.metrics.control_lost.labels(kind, reason.value).inc()
        logger.warning("could not send %s to %r (%s): %s", kind, identity, reason.value, exc)
        if self.on_lost is None:
            return
        lost = LostSend(identity, msg, reason, num_resends)
        try:  # the caller is mid-way through its own work: report it next turn
            asyncio.get_running_loop().call_soon(self.on_lost, lost)
        except RuntimeError:  # no loop runs (shutting down): nobody to tell
            pass

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self._auth.stop()
        self.sock.close()
        self.ctx.term()
