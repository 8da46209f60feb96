"""What the dispatcher does about a message to a worker that ZeroMQ did not take (issue 16
item 6): the worker's queue is at its high-water mark (thousands of messages unread: it
is stuck) or it has no connection (dead, or cut off). Detected, never only logged:

    lost                                 then
    Generate, Prefill, KVPlan            that attempt fails and the worker is treated as
                                         dead (mark_dead): the attempt is retried on other
                                         workers by the retry policy, or the client gets
                                         the error. Failing the attempt alone would not
                                         do: an idle-looking stuck worker would draw the
                                         retry straight back and burn the retry budget.
    anything else (Abort, EvictBlocks,   resent after 0.1, 0.2, 0.4 and 0.8 s; lost a fifth
    ResyncKV, Shutdown, CheckPool, ...)  time, the worker is treated as dead
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
        self._closed = False

    def on_lost(self, lost: LostSend) -> None:
        if self._closed:  # shutting down: Shutdowns to workers already gone are moot
            return
        kind = type(lost.msg).__name__
        why = f"did not take {kind} ({lost.reason.value})"
        if isinstance(lost.msg, _REQUEST_MESSAGES):
            # Only if that attempt is still current and on that worker: a late report of
            # a retried, aborted or finished attempt changes nothing.
            rid = lost.msg.request_id
            flight = self.flights.attempt(rid)
            if flight is None or lost.identity not in flight.workers:
                return
            self.mark_dead(lost.identity, why)  # fails its attempts, this one included
            if self.flights.attempt(rid) is flight:  # it was not registered: fail it here
                name = lost.identity.decode(errors="replace")
                self.fail_attempt(flight, FailureKind.WORKER_DEAD,
                                  WorkerFailed(f"worker {name}: {why}"))
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
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
