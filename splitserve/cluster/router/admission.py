"""Admission control (DESIGN.md 5): when the router finds every worker over budget,
requests wait in a bounded FIFO; beyond its bound the caller answers 429 with
`Retry-After: retry_after_s()`.

Pure logic: the caller passes the clock (`now`, monotonic seconds) and serializes calls.
The dispatcher's loop is

    if router.route(req) is None and not queue.offer(req, now):
        reply 429, Retry-After = ceil(queue.retry_after_s(now))
    ...whenever load or workers change:
    for req, decision in queue.pop_ready(lambda r: router.route(r.route_request), now):
        dispatch(req, decision)
    for req in queue.expire(now): reply 503 (waited longer than max_wait_s)
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
D = TypeVar("D")


class AdmissionQueue(Generic[T]):
    """Bounded FIFO of requests waiting for capacity, with a service-rate estimate."""

    def __init__(self, max_len: int, max_wait_s: float | None = None, *,
                 rate_window_s: float = 30.0, min_retry_after_s: float = 1.0,
                 max_retry_after_s: float = 60.0) -> None:
        """`max_wait_s`: how long an item may wait before `expire` returns it (None: no
        limit). The service rate is the number of items that left the queue by
        `pop_ready` in the last `rate_window_s` seconds; `retry_after_s` is clamped to
        [min_retry_after_s, max_retry_after_s]."""
        if max_len < 0:
            raise ValueError(f"max_len={max_len} must be >= 0 (0 rejects whenever busy)")
        self.max_len = max_len
        self.max_wait_s = max_wait_s
        self.min_retry_after_s = min_retry_after_s
        self.max_retry_after_s = max_retry_after_s
        self._items: deque[tuple[T, float]] = deque()  # (item, enqueued at)
        self._served = ServiceRate(rate_window_s)  # items that left by pop_ready
        self.num_rejected = 0
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def is_full(self) -> bool:
        return len(self._items) >= self.max_len

    def offer(self, item: T, now: float) -> bool:
        """Enqueue `item`; False (and counted as rejected) when the queue is full."""
        if self.is_full:
            self.num_rejected += 1
            return False
        self._items.append((item, now))
        return True

    def peek(self) -> T | None:
        """The oldest waiting item, or None."""
        return self._items[0][0] if self._items else None

    def pop_ready(self, place: Callable[[T], D | None], now: float) -> list[tuple[T, D]]:
        """Place waiting items oldest first with `place` (e.g. `Router.route`) until one
        cannot be placed (returns None), which keeps its turn: strict FIFO, so a big
        request is not starved by small ones. Returns the placed items with their
        placements."""
        placed: list[tuple[T, D]] = []
        while self._items:
            item = self._items[0][0]
            decision = place(item)
            if decision is None:
                break
            self._items.popleft()
            self._served.record(now)
            placed.append((item, decision))
        return placed

    def remove(self, item: T) -> bool:
        """Drop a waiting item (its client went away); False when it is not queued."""
        for i, (queued, _) in enumerate(self._items):
            if queued is item:
                del self._items[i]
                return True
        return False

    def expire(self, now: float) -> list[T]:
        """Remove and return items that waited longer than `max_wait_s`."""
        expired: list[T] = []
        if self.max_wait_s is None:
            return expired
        while self._items and now - self._items[0][1] > self.max_wait_s:
            expired.append(self._items.popleft()[0])
        self.num_expired += len(expired)
        return expired

    def retry_after_s(self, now: float) -> float:
        """Seconds a rejected client should wait (see `retry_after_s` below)."""
        return retry_after_s(len(self._items), self._served.rate(now),
                             self.min_retry_after_s, self.max_retry_after_s)


class ServiceRate:
    """Events per second over a sliding window of their times (e.g. requests placed or
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
