"""BenchRequest: one request of a workload, as the client will send it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class BenchRequest:
    """One request to send. `after`: index of the request (the previous turn of the same
    session) that must have finished before this one is sent. `timestamp_s`: the trace's
    arrival time (unscaled), None for generated workloads."""
    prompt_token_ids: list[int]
    output_len: int
    session_id: int | None = None
    after: int | None = None
    timestamp_s: float | None = None
