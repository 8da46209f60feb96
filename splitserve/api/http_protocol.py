"""uvicorn as the HTTP edge runs it: its h11 protocol plus a deadline on request heads.

uvicorn 0.54 bounds a request head's size (`h11_max_incomplete_event_size`), the idle time
between requests (`timeout_keep_alive`) and the connections and requests in progress
(`limit_concurrency`: 503 beyond it), but not the time a head takes to arrive: a client
sending one byte a second (slowloris) holds its connection, and a slot under the limit,
forever. `HeadDeadlineH11Protocol` closes a connection whose head is not complete
`header_timeout_s` after the connection opened or the head's first byte came, with a
408. Bodies have their own deadline (api/middleware.BodyMiddleware).

    connection opens ── head ≤ header_timeout_s ──> app (body ≤ body_timeout_s) ── response
         ^                                                                            |
         └─ idle ≤ timeout_keep_alive ── first byte of the next head ─────────────────┘
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from splitserve.config import HttpConfig

logger = logging.getLogger("splitserve.api")
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8"
                     b"\r\nconnection: close\r\ncontent-length: 27\r\n\r\n"
                     b"request head took too long\n")


class HeadDeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head."""

    header_timeout_s: float = 20.0  # set per server by `protocol_class`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of a keep-alive connection's next request
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is parsed: the app has the request now

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expired(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        logger.info("%s: no complete request head within %g s; closing the connection",
                    "%s:%d" % self.client if self.client else "client", self.header_timeout_s)
        # NOTE: h11 cannot send a response before it has a request, so the 408 is written
        # as bytes; the connection ends with it.
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def protocol_class(header_timeout_s: float) -> type[HeadDeadlineH11Protocol]:
    """The protocol class for one server's head deadline."""
    return type("HeadDeadlineH11Protocol", (HeadDeadlineH11Protocol,),
                {"header_timeout_s": header_timeout_s})


def uvicorn_config(app: Any, http: HttpConfig, **kwargs: Any) -> uvicorn.Config:
    """uvicorn.Config for `app` with HttpConfig's limits and deadlines (the body deadline
    is the app's: api/server.build_app)."""
    return uvicorn.Config(app, http=protocol_class(http.header_timeout_s),
                          limit_concurrency=http.limit_concurrency,
                          timeout_keep_alive=http.timeout_keep_alive,
                          h11_max_incomplete_event_size=http.h11_max_incomplete_event_size,
                          **kwargs)
