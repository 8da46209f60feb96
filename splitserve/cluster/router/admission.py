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

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
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
    finished). Events are counted in NUM_BUCKETS slices of the window, so memory stays
    the same at any rate (a deque of every event's time grew with the traffic)."""

    NUM_BUCKETS = 64

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._bucket_s = window_s / self.NUM_BUCKETS
        self._buckets: deque[_Bucket] = deque()  # oldest first, at most NUM_BUCKETS + 1

    def record(self, now: float) -> None:
        index = math.floor(now / self._bucket_s)
        last = self._buckets[-1] if self._buckets else None
        if last is not None and last.index == index:
            last.count += 1
            last.last_s = now
        else:
            self._buckets.append(_Bucket(index, now, now, 1))
        self._forget_old(now)

    def rate(self, now: float) -> float | None:
        """Events per second in the window; None when there were none."""
        self._forget_old(now)
        if not self._buckets:
            return None
        # one event is not a rate per 0 seconds
        span = max(now - self._buckets[0].first_s, 1.0)
        return sum(b.count for b in self._buckets) / span

    def _forget_old(self, now: float) -> None:
        # NOTE: a slice goes when its newest event leaves the window, so older events of
        # it may count for up to one slice (window / NUM_BUCKETS) longer.
        while self._buckets and now - self._buckets[0].last_s > self.window_s:
            self._buckets.popleft()


@dataclass(slots=True)
class _Bucket:
    index: int  # floor(time / bucket_s)
    first_s: float
    last_s: float
    count: int


def retry_after_s(num_queued: int, rate: float | None, min_s: float, max_s: float) -> float:
    """Seconds a rejected client should wait: time to serve the queue and itself at
    `rate` (per second), clamped to [min_s, max_s]; max_s when nothing was served lately
    (the cluster is stuck or just started, so no estimate is honest)."""
    if rate is None:
        return max_s
    return min(max_s, max(min_s, (num_queued + 1) / rate))
