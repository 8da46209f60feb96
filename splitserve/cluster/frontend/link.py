"""The frontend's socket to its workers: one ZeroMQ ROUTER, frames encoded by protocol.py.

Sends never block the event loop (a worker that is gone or not reading loses the
message, which is logged: its heartbeat deadline then removes it); received frames are
decoded and handed to one callback with the sender's routing id.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from splitserve.cluster import protocol as P
from splitserve.errors import ProtocolError

logger = logging.getLogger(__name__)


class WorkerLink:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a gone worker raises
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"

    async def receive(self, on_message: Callable[[bytes, P.Message], None]) -> None:
        """Runs until cancelled: decodes each frame and calls on_message(identity, msg)."""
        while True:
            identity, frame = await self.sock.recv_multipart()
            try:
                on_message(identity, P.decode(frame))
            except ProtocolError as exc:
                logger.warning("refused a message from %r: %s", identity, exc)
            except Exception:  # one bad message must not stop the frontend
                logger.exception("failed to handle a message from %r", identity)

    def send(self, identity: bytes, msg: P.Message) -> None:
        kind = type(msg).__name__

        def check(fut: asyncio.Future[object]) -> None:
            exc = None if fut.cancelled() else fut.exception()
            if exc is not None:  # the worker is gone (ROUTER_MANDATORY) or stuck
                logger.warning("could not send %s to %r: %s", kind, identity, exc)
        try:
            fut = self.sock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("could not send %s to %r: %s", kind, identity, exc)
            return
        fut.add_done_callback(check)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
