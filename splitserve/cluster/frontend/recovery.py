"""What the frontend does when part of a request's path fails (DESIGN 7): a policy the
dispatcher carries out. Pure decisions, no state of its own.

A request runs as one attempt at a time (frontend/flight.py). When an attempt fails, the
dispatcher asks `RetryPolicy.should_retry`; a retry starts a new attempt on other workers
under a new id, resuming from the tokens already merged (the engine replays prompt + those
tokens and samples on exactly as the unbroken run would); with no decode worker up, it
waits (within its stage deadline) for a restarted one when `wait_for_restarts`. The retry
budget counts the retries since the request last decoded (`should_retry`).

    failure (FailureKind)                    retried?
    worker_dead: died, went silent           yes: resume on other workers
    worker_error (not a bad request)         yes
    timeout_prefill/handoff/decode           yes
    kv_transfer: failed, timed out, corrupt  --kv-failure-policy: recompute (the decode
                                             worker prefills locally, no round trip: the
                                             frontend sees no failure), retry (a new
                                             attempt, a new transfer), fail
    invalid, bad_output, timeout_queue,      no: the client gets the error
    timeout_request
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from splitserve.cluster.frontend.flight import Flight, FlightState
from splitserve.cluster.protocol import FailureKind

_NEVER_RETRIED = frozenset({FailureKind.INVALID_REQUEST, FailureKind.BAD_OUTPUT,
                            FailureKind.TIMEOUT_QUEUE, FailureKind.TIMEOUT_REQUEST})


class KVFailurePolicy(str, Enum):
    """What a failed KV transfer or import leads to (`--kv-failure-policy`)."""
    RECOMPUTE = "recompute"  # the decode worker prefills locally
    RETRY = "retry"  # a new attempt: prefill and transfer again
    FAIL = "fail"  # the client gets the error


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int = 2
    kv_failure_policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE
    # With no decode worker up, a retry waits (within its stage deadline) for a restarted
    # one, and so does a new request (in the admission queue, within its queue deadline),
    # instead of failing at once; set when workers are restarted.
    wait_for_restarts: bool = False

    def is_retryable(self, kind: FailureKind) -> bool:
        if kind is FailureKind.KV_TRANSFER:
            return self.kv_failure_policy is KVFailurePolicy.RETRY
        return kind not in _NEVER_RETRIED

    def should_retry(self, flight: Flight, kind: FailureKind, now: float) -> bool:
        """Whether the failed attempt gets a successor: a retryable failure, retry budget
        left, the request dispatched (a queued one has no attempt) and within its deadline.

        The budget is `max_retries` in a row before the request decodes again
        (`Flight.num_retries`): it stops a request that cannot get going (a poison
        prompt, a transfer path that always fails), not one that met several unrelated
        failures in a long life and recovered from each. Each fresh start costs a new
        token, so `max_tokens` and the request deadline still bound the whole."""
        return (self.is_retryable(kind) and flight.num_retries < self.max_retries
                and FlightState.PREFILL <= flight.state < FlightState.FINISHED
                and now < flight.deadline)


def stale_hashes(flight: Flight, num_cached_tokens: int, block_size: int) -> list[bytes]:
    """The router expected the worker that prefills to have `flight.expected_hit` prompt
    tokens cached; if it had fewer, the index is stale for that worker (DESIGN 7): the
    block hashes it relied on and the worker no longer has."""
    assert flight.route_req is not None and flight.expected_hit is not None
    n = len(flight.request.prompt_token_ids)
    # The last prompt token is always computed, so a hit covers at most the blocks before it.
    expected = min(flight.expected_hit, (n - 1) // block_size * block_size)
    if num_cached_tokens >= expected:
        return []
    return flight.route_req.block_hashes[num_cached_tokens // block_size:expected // block_size]
