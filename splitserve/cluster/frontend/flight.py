"""One request in the cluster, as the dispatcher tracks it: its state, deadlines, the
workers holding state for it, its merged stream and its timestamps.

    QUEUED --admitted--> PREFILL --token 1 from P--> HANDOFF --D streams--> DECODE
                            \\---------token 1 from D (local prefill)------/     |
                                                                    FINISHED | FAILED

A retry (frontend/recovery.py) goes back to PREFILL under a new attempt id.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta, StreamMerger
from splitserve.cluster.protocol import FailureKind, Output
from splitserve.cluster.router.placement import RouteDecision, RouteRequest
from splitserve.config import DeadlineConfig
from splitserve.errors import InvalidRequestError, RequestTimeout


class FlightState(IntEnum):
    """Where a request is; the two ends sort last (`is_over`)."""
    QUEUED = 0  # waiting for admission
    PREFILL = 1  # dispatched, no token yet
    HANDOFF = 2  # token 1 came from the prefill worker; the decode worker has not gone on
    DECODE = 3  # the decode worker streams
    FINISHED = 4  # the stream ended
    FAILED = 5  # an error was queued for the client


class Outcome(str, Enum):
    """How a request ended, as counted in `splitserve_requests_total{outcome}`."""
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"  # the client went away
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass(slots=True)
class Flight:
    """One request in the cluster: where it runs, its stream, its deadlines.

    A request runs as one attempt at a time. A retry (after a worker died, a transfer
    failed or a stage stalled) starts a new attempt under a new id (`attempt_id`), which
    resumes from the tokens merged so far; late messages of an old attempt name an id
    nobody answers to, so they are dropped (a fencing token per request)."""
    request: GenerateRequest
    arrival: float
    deadline: float
    stage_deadline: float
    state: FlightState = FlightState.QUEUED
    queue: asyncio.Queue[StreamDelta | BaseException] = field(default_factory=asyncio.Queue)
    merger: StreamMerger = field(default_factory=StreamMerger)
    attempt: int = 0
    # Retries since the request last got to DECODE: what the retry budget counts (recovery.py).
    num_retries: int = 0
    resumed: list[int] = field(default_factory=list)  # tokens the current attempt resumes
    # Prompt tokens the router expected the prefilling worker to have cached; compared with
    # the real hit on its first output, then None (cluster/frontend/recovery.py).
    expected_hit: int | None = None
    route_req: RouteRequest | None = None
    admitted: asyncio.Future[RouteDecision] | None = None  # set when it leaves the queue
    decision: RouteDecision | None = None
    workers: set[bytes] = field(default_factory=set)  # identities holding state for it
    done_workers: set[bytes] = field(default_factory=set)  # hold nothing for it any more
    prefill_worker: bytes | None = None
    # Peer fetch: the worker exporting the prompt's prefix to the decode worker. Never
    # needed: if it fails, the decode worker is told to prefill it all (CancelImport).
    peer_worker: bytes | None = None
    # The decode worker's outputs that came before the prefill worker's token 1 (`hold`).
    held: list[tuple[bytes, Output]] = field(default_factory=list)
    dispatched_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def attempt_id(self) -> str:
        """The id the workers know the current attempt by."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}#{self.attempt}"

    @property
    def is_over(self) -> bool:
        return self.state >= FlightState.FINISHED

    def needs(self, identity: bytes) -> bool:
        """Whether the current attempt still depends on that worker: not once it holds
        nothing for it, nor a prefill worker once the decode worker streams."""
        if identity in self.done_workers or identity == self.peer_worker:
            return False
        return not (identity == self.prefill_worker and self.state >= FlightState.DECODE)

    def hold(self, identity: bytes, out: Output) -> bool:
        """Keeps a decode worker's output that starts past the stream while the prefill
        worker's token 1 is on its way: D streams token 2 once P's KV, which carries token
        1, landed, but P's Output with token 1 travels on another connection and may be
        read second. True when kept (in `held`, until token 1 is merged)."""
        if self.prefill_worker in (None, identity) or not self.merger.is_ahead(out):
            return False
        self.held.append((identity, out))
        return True

    def advance(self, state: FlightState, now: float, deadlines: DeadlineConfig) -> None:
        """Moves to PREFILL, HANDOFF or DECODE and arms that stage's timeout. Decoding
        means the recovery so far worked: the retry budget starts over."""
        self.state = state
        if state is FlightState.DECODE:
            self.num_retries = 0
        timeout = {FlightState.PREFILL: deadlines.prefill_timeout_s,
                   FlightState.HANDOFF: deadlines.kv_timeout_s + deadlines.decode_step_timeout_s,
                   FlightState.DECODE: deadlines.decode_step_timeout_s}[state]
        self.stage_deadline = now + timeout

    def next_attempt(self, now: float, deadlines: DeadlineConfig) -> str:
        """Forgets the current attempt's workers; returns the new attempt's id."""
        self.attempt += 1
        self.num_retries += 1
        self.resumed = list(self.merger.token_ids)
        self.workers.clear()
        self.done_workers.clear()
        self.held.clear()
        self.prefill_worker = self.peer_worker = self.decision = None
        self.expected_hit = None  # resumed attempts' hits are not the router's prediction
        self.advance(FlightState.PREFILL, now, deadlines)  # until it streams a new token
        return self.attempt_id

    def next_due(self) -> float:
        """The earliest time `overdue` can report a timeout (inf: none can come)."""
        if self.is_over:
            return math.inf
        if self.state is FlightState.QUEUED:  # the queue timeout (or request deadline)
            waiting = self.admitted is not None and not self.admitted.done()
            return self.stage_deadline if waiting else math.inf
        return min(self.deadline, self.stage_deadline)

    def overdue(self, now: float, queue_timeout_s: float
                ) -> tuple[FailureKind, RequestTimeout] | None:
        """The timeout this request passed by `now`, reported once (then None): the queue
        timeout or request deadline while queued, else the request deadline or the
        current stage's timeout (prefill: first token; handoff: the decode worker going
        on; decode: gap between tokens)."""
        if self.is_over:
            return None
        if self.state is FlightState.QUEUED:
            if now < self.stage_deadline or self.admitted is None or self.admitted.done():
                return None
            message = (f"no worker had room, or none was up, for {now - self.arrival:.1f} s "
                       f"(queue timeout {queue_timeout_s:g} s or the request deadline)")
            return FailureKind.TIMEOUT_QUEUE, RequestTimeout(message, stage="queue")
        if now >= self.deadline:
            self.stage_deadline = self.deadline = math.inf
            return FailureKind.TIMEOUT_REQUEST, RequestTimeout(
                f"request {self.request.request_id} passed the request deadline in stage "
                f"{self.state.name.lower()}", stage="request")
        if now < self.stage_deadline:
            return None
        self.stage_deadline = math.inf  # the retry re-arms it; the request deadline holds
        stage = self.state.name.lower()
        return FailureKind(f"timeout_{stage}"), RequestTimeout(
            f"request {self.request.request_id} passed a stage timeout in stage {stage}",
            stage=stage)


class FlightTable:
    """Every request in flight: by request id, by its current attempt's id (what the
    workers know it by: an old attempt's id finds nothing), and the retries waiting for a
    decode worker to register."""

    def __init__(self) -> None:
        self._by_request: dict[str, Flight] = {}
        self._by_attempt: dict[str, Flight] = {}
        self.stranded: list[Flight] = []

    def __len__(self) -> int:
        return len(self._by_request)

    def __getitem__(self, request_id: str) -> Flight:
        return self._by_request[request_id]

    def __iter__(self) -> Iterator[Flight]:
        return iter(list(self._by_request.values()))

    def add(self, flight: Flight) -> None:
        rid = flight.request.request_id
        if rid in self._by_request:
            raise InvalidRequestError(f"request id {rid!r} is already in flight",
                                      field="request_id")
        self._by_request[rid] = self._by_attempt[rid] = flight

    def attempt(self, attempt_id: str) -> Flight | None:
        """The live flight whose current attempt is `attempt_id`."""
        flight = self._by_attempt.get(attempt_id)
        return None if flight is None or flight.is_over else flight

    def next_attempt(self, flight: Flight, now: float, deadlines: DeadlineConfig) -> str:
        """Re-keys the flight under its next attempt; the new attempt's id."""
        self._by_attempt.pop(flight.attempt_id, None)
        aid = flight.next_attempt(now, deadlines)
        self._by_attempt[aid] = flight
        return aid

    def remove(self, flight: Flight) -> None:
        self._by_request.pop(flight.request.request_id, None)
        self._by_attempt.pop(flight.attempt_id, None)
        if flight in self.stranded:
            self.stranded.remove(flight)
