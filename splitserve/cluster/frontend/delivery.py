"""What the dispatcher does about a message to a worker that ZeroMQ did not take (issue 16
item 6): the worker's queue is at its high-water mark (it has not read for thousands of
messages: stuck) or it has no connection. Detected, never only logged:

    lost                                 then
    Generate, Prefill, KVPlan            that attempt fails (worker_dead): the retry policy
                                         starts another or the client gets the error, as
                                         for any failed attempt (dispatcher.fail_attempt)
    anything else (Abort, EvictBlocks,   resent after 0.1, 0.2, 0.4 and 0.8 s; lost a fifth
    ResyncKV, Shutdown, CheckPool, ...)  time, the worker is treated as dead (mark_dead:
                                         its attempts are retried elsewhere)

A stuck worker is thus out of routing about 1.5 s after its first lost message: the
failed attempt's Abort to it is lost and resent like any other.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from splitserve.cluster import protocol as P
from splitserve.cluster.frontend.flight import Flight, FlightTable
from splitserve.cluster.frontend.link import LostSend, WorkerLink
from splitserve.cluster.protocol import FailureKind
from splitserve.errors import SplitserveError, WorkerFailed

RESEND_DELAYS_S = (0.1, 0.2, 0.4, 0.8)
_REQUEST_MESSAGES = (P.Generate, P.Prefill, P.KVPlan)


class Redelivery:
    def __init__(self, link: WorkerLink, flights: FlightTable,
                 fail_attempt: Callable[[Flight, FailureKind, SplitserveError], None],
                 mark_dead: Callable[[bytes, str], None]) -> None:
        """The dispatcher's `fail_attempt` and `mark_dead` carry the decisions out."""
        self.link, self.flights = link, flights
        self.fail_attempt, self.mark_dead = fail_attempt, mark_dead
        self._timers: set[asyncio.TimerHandle] = set()

    def on_lost(self, lost: LostSend) -> None:
        kind = type(lost.msg).__name__
        why = f"could not deliver {kind} ({lost.reason.value})"
        if isinstance(lost.msg, _REQUEST_MESSAGES):
            # Only if that attempt is still current and on that worker: a late report of
            # a retried, aborted or finished attempt changes nothing.
            flight = self.flights.attempt(lost.msg.request_id)
            if flight is not None and lost.identity in flight.workers:
                name = lost.identity.decode(errors="replace")
                self.fail_attempt(flight, FailureKind.WORKER_DEAD, WorkerFailed(
                    f"worker {name}: {why}; it is not reading or not connected"))
            return
        if lost.num_resends >= len(RESEND_DELAYS_S):
            self.mark_dead(lost.identity, f"{why} after {lost.num_resends} resends")
            return
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def resend() -> None:
            assert timer is not None
            self._timers.discard(timer)
            self.link.send(lost.identity, lost.msg, lost.num_resends + 1)
        timer = loop.call_later(RESEND_DELAYS_S[lost.num_resends], resend)
        self._timers.add(timer)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
