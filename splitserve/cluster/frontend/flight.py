"""One request in the cluster, as the dispatcher tracks it: stage, deadlines, the
workers holding state for it, its merged stream and its timestamps."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from enum import IntEnum

from splitserve.cluster import protocol as P
from splitserve.cluster.router.placement import RouteDecision, RouteRequest
from splitserve.cluster.frontend.stream import GenerateRequest, StreamDelta, StreamMerger
from splitserve.errors import RequestTimeout


class Stage(IntEnum):
    QUEUED = 0  # waiting for admission
    PREFILL = 1  # dispatched, no token yet
    DECODE = 2  # streaming


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
    stage: Stage = Stage.QUEUED
    queue: asyncio.Queue[StreamDelta | BaseException] = field(default_factory=asyncio.Queue)
    merger: StreamMerger = field(default_factory=StreamMerger)
    attempt: int = 0
    resumed: list[int] = field(default_factory=list)  # tokens the current attempt resumes
    failed: bool = False  # an error was queued for the client
    cache_checked: bool = False  # the routed prefix hit was compared with the real one
    route_req: RouteRequest | None = None
    admitted: asyncio.Future[RouteDecision] | None = None  # set when it leaves the queue
    decision: RouteDecision | None = None
    workers: set[bytes] = field(default_factory=set)  # identities holding state for it
    done_workers: set[bytes] = field(default_factory=set)  # reported it finished
    prefill_worker: bytes | None = None
    dispatched_at: float | None = None
    first_token_at: float | None = None
    decode_output_seen: bool = False  # remote prefill: the decode worker's first output came
    last_token_at: float | None = None

    @property
    def attempt_id(self) -> str:
        """The id the workers know the current attempt by."""
        rid = self.request.request_id
        return rid if self.attempt == 0 else f"{rid}#{self.attempt}"

    @property
    def is_over(self) -> bool:
        return self.failed or self.merger.finished

    def needs(self, identity: bytes) -> bool:
        """Whether the current attempt still depends on that worker: not once it said
        it finished, nor a prefill worker once the decode worker committed its KV."""
        if identity in self.done_workers:
            return False
        return not (identity == self.prefill_worker and self.decode_output_seen)

    def next_attempt(self) -> str:
        """Forgets the current attempt's workers; returns the new attempt's id."""
        self.attempt += 1
        self.resumed = list(self.merger.token_ids)
        self.workers.clear()
        self.done_workers.clear()
        self.prefill_worker = self.decision = None
        self.decode_output_seen = False
        self.cache_checked = True  # resumed attempts' hits are not the router's prediction
        return self.attempt_id

    def overdue(self, now: float, queue_timeout_s: float) -> RequestTimeout | None:
        """The timeout this request passed by `now`, reported once (then None): the queue
        timeout or request deadline while queued, else the request deadline or the
        current stage's timeout (prefill: first token; decode: gap between tokens)."""
        if self.stage is Stage.QUEUED:
            if now < self.stage_deadline or self.admitted is None or self.admitted.done():
                return None
            message = (f"no worker had room for {now - self.arrival:.1f} s (queue timeout "
                       f"{queue_timeout_s:g} s or the request deadline)")
            return RequestTimeout(message, stage="queue")
        if now >= self.deadline:
            stage, what = "request", "the request deadline"
        elif now >= self.stage_deadline:
            stage, what = self.stage.name.lower(), "a stage timeout"
        else:
            return None
        self.stage_deadline = self.deadline = math.inf
        return RequestTimeout(f"request {self.request.request_id} passed {what} in stage "
                              f"{stage}", stage=stage)
