"""A worker as the router sees it: its role, its last load report, the load the router
itself sent it since that report, and its fitted cost models.

Load reports lag: without the in-flight tally a burst of requests routed between two
reports would all see the same idle worker and land on it. `InFlight` adds what the
router dispatched and no report has counted yet. A report names the requests that reached
the worker since the one before (`LoadReport.received`): their shares leave the tally,
the report counting them now; a request dispatched after the report was taken keeps its
share until a later report names it (a report in flight when a request was dispatched
used to absorb it, and the worker looked idle until the next one: the router then placed
the next request beside it). A request that finishes before a report counts it takes its
share back out. The other way round, a request a report counted stops counting when the
worker sends its last output (`done`), not at the next report: a closed-loop client's
next request, milliseconds later, saw the worker still running the one before, and half
of such requests went to a worker decoding something else.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from splitserve.cluster.protocol import Role
from splitserve.cluster.router.cost_model import CostModelConfig, DecodeStepModel, PrefillCostModel
from splitserve.cluster.router.scoring import WorkerTerms


@dataclass(slots=True)
class WorkerLoad:
    """What a worker's load report says."""

    num_running: int
    num_waiting: int
    num_waiting_tokens: int  # prompt tokens to prefill (uncached): waiting and prefilling
    kv_blocks_used: int
    kv_blocks_total: int
    max_num_seqs: int
    num_prefilling: int = 0  # running, prompt not all computed (in the tokens above)
    max_num_partial_prefills: int = 1  # prompts one step's budget is shared among
    pace_s: float = 0.0  # WorkerReady.pace_s (0: none)
    borrows_cores: bool = False  # WorkerReady.borrows_cores: its steps are not pooled


@dataclass(slots=True)
class InFlight:
    """Load dispatched to a worker and not yet visible in its load report."""

    num_running: int = 0  # sequences whose KV arrives by transfer (no prefill here)
    num_waiting: int = 0  # sequences this worker will prefill
    num_waiting_tokens: int = 0
    kv_blocks: int = 0

    def add(self, other: InFlight, sign: int) -> None:
        self.num_running += sign * other.num_running
        self.num_waiting += sign * other.num_waiting
        self.num_waiting_tokens += sign * other.num_waiting_tokens
        self.kv_blocks += sign * other.kv_blocks


@dataclass(slots=True)
class WorkerState:
    """One registered worker: role, reported load plus in-flight tally, cost models."""

    role: Role
    load: WorkerLoad
    prefill_model: PrefillCostModel
    decode_model: DecodeStepModel
    pending: dict[str, InFlight] = field(default_factory=dict)  # request id -> its share
    in_flight: InFlight = field(default_factory=InFlight)  # sum of `pending`
    reported: dict[str, InFlight] = field(default_factory=dict)  # absorbed by a report
    ended: InFlight = field(default_factory=InFlight)  # reported ones done since the report
    # (dispatch time, predicted seconds) of the prompts routed here to prefill locally,
    # kept for the TPOT horizon: together they stall this worker's running decodes.
    local_prefills: deque[tuple[float, float]] = field(default_factory=deque)

    @staticmethod
    def create(role: Role, load: WorkerLoad, config: CostModelConfig,
               pooled_prefill: PrefillCostModel,
               pooled_decode: DecodeStepModel) -> WorkerState:
        """A worker whose cost models fall back to the pooled ones until fitted."""
        return WorkerState(role, load, PrefillCostModel(config, pooled_prefill),
                           DecodeStepModel(config, pooled_decode))

    @property
    def num_running(self) -> int:
        return max(0, self.load.num_running + self.in_flight.num_running
                   - self.ended.num_running)

    @property
    def num_waiting(self) -> int:
        return self.load.num_waiting + self.in_flight.num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        return self.load.num_waiting_tokens + self.in_flight.num_waiting_tokens

    @property
    def num_free_blocks(self) -> int:
        load = self.load
        return min(load.kv_blocks_total, load.kv_blocks_total - load.kv_blocks_used
                   - self.in_flight.kv_blocks + self.ended.kv_blocks)

    def is_full(self) -> bool:
        """No room for another sequence (running + waiting >= max_num_seqs)."""
        return self.num_running + self.num_waiting >= self.load.max_num_seqs

    def terms(self, now: float, horizon_s: float) -> WorkerTerms:
        """The request-independent scoring terms as of `now`; local prefills count for
        `horizon_s` after their dispatch."""
        self.expire_local_prefills(now - horizon_s)
        a, b, c = self.prefill_model.coefficients
        return WorkerTerms(
            a, b, c, self.num_waiting + self.load.num_prefilling, self.num_waiting_tokens,
            self.load.max_num_partial_prefills - 1,
            self.decode_model.predict(self.num_running + 1), self.num_running,
            sum(seconds for _, seconds in self.local_prefills), self.load.pace_s,
            self.num_free_blocks, self.load.kv_blocks_total, not self.is_full(),
            self.role == Role.PREFILL)

    def expire_local_prefills(self, before: float) -> bool:
        """Forget local prefills dispatched before `before`; True if any went."""
        expired = False
        while self.local_prefills and self.local_prefills[0][0] < before:
            self.local_prefills.popleft()
            expired = True
        return expired

    def report(self, load: WorkerLoad, received: Collection[str] | None = None) -> None:
        """A new load report: the load it counts replaces the shares of the requests in
        `received` (None: of every pending one) and what ended since the last."""
        self.load = load
        for request_id in list(self.pending) if received is None else received:
            share = self.pending.pop(request_id, None)
            if share is not None:
                self.reported[request_id] = share
        self.in_flight = InFlight()
        for share in self.pending.values():
            self.in_flight.add(share, 1)
        self.ended = InFlight()

    def dispatch(self, request_id: str, share: InFlight) -> None:
        self.pending[request_id] = share
        self.in_flight.add(share, 1)

    def done(self, request_id: str) -> None:
        """The worker sent the request's last output: it runs and holds its blocks no more,
        whether or not a report counted it (the worker's next report will not)."""
        share = self.pending.pop(request_id, None)
        if share is not None:
            self.in_flight.add(share, -1)
            return
        share = self.reported.pop(request_id, None)
        if share is not None:  # the last report counted it running (its blocks: at least these)
            self.ended.add(InFlight(num_running=1, kv_blocks=share.kv_blocks), 1)

    def finish(self, request_id: str) -> None:
        """The request left the frontend: take back its share if no report has absorbed it
        yet (one that did is the worker's to drop from its next report)."""
        share = self.pending.pop(request_id, None)
        if share is not None:
            self.in_flight.add(share, -1)
        self.reported.pop(request_id, None)
