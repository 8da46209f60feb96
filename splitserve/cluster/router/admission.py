"""Admission control (DESIGN.md 5): when the router finds every worker over budget,
requests wait in a bounded FIFO; beyond its bound the caller answers 429 with
`Retry-After: Router.retry_after_s(len(queue))`, the time to serve the queue at the rate
requests finished lately (`ServiceRate`, `retry_after_s` below).

Pure logic: the caller serializes calls and enforces the queue deadline itself. The
dispatcher's loop is

    if router.route(req) is None and not queue.offer(req):
        reply 429, Retry-After = ceil(router.retry_after_s(len(queue)))
    ...whenever load or workers change:
    for req, decision in queue.pop_ready(lambda r: router.route(r.route_request)):
        dispatch(req, decision)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
D = TypeVar("D")


class AdmissionQueue(Generic[T]):
    """Bounded FIFO of requests waiting for capacity."""

    def __init__(self, max_len: int) -> None:
        if max_len < 0:
            raise ValueError(f"max_len={max_len} must be >= 0 (0 rejects whenever busy)")
        self.max_len = max_len
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: T) -> bool:
        """Enqueue `item`; False when the queue is full."""
        if len(self._items) >= self.max_len:
            return False
        self._items.append(item)
        return True

    def pop_ready(self, place: Callable[[T], D | None]) -> list[tuple[T, D]]:
        """Place waiting items oldest first with `place` (e.g. `Router.route`) until one
        cannot be placed (returns None), which keeps its turn: strict FIFO, so a big
        request is not starved by small ones. Returns the placed items with their
        placements."""
        placed: list[tuple[T, D]] = []
        while self._items:
            decision = place(self._items[0])
            if decision is None:
                break
            placed.append((self._items.popleft(), decision))
        return placed

    def remove(self, item: T) -> bool:
        """Drop a waiting item (its client went away, or its queue deadline passed);
        False when it is not queued."""
        for i, queued in enumerate(self._items):
            if queued is item:
                del self._items[i]
                return True
        return False


class ServiceRate:
    """Events per second over a sliding window of their times (the router's: requests
    finished)."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()

    def record(self, now: float) -> None:
        self._times.append(now)
        self._forget_old(now)

    def rate(self, now: float) -> float | None:
        """Events per second in the window; None when there were none."""
        self._forget_old(now)
        if not self._times:
            return None
        span = max(now - self._times[0], 1.0)  # one event is not a rate per 0 seconds
        return len(self._times) / span

    def _forget_old(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


def retry_after_s(num_queued: int, rate: float | None, min_s: float, max_s: float) -> float:
    """Seconds a rejected client should wait: time to serve the queue and itself at
    `rate` (per second), clamped to [min_s, max_s]; max_s when nothing was served lately
    (the cluster is stuck or just started, so no estimate is honest)."""
    if rate is None:
        return max_s
    return min(max_s, max(min_s, (num_queued + 1) / rate))
