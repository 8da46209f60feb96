"""AdmissionQueue: bound, strict FIFO placement, expiry, Retry-After estimate."""
from __future__ import annotations

import pytest

from splitserve.cluster.router.admission import AdmissionQueue, ServiceRate, retry_after_s


def test_full_queue_rejects() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=2)
    assert queue.offer("a", 0.0) and queue.offer("b", 0.0)
    assert queue.is_full
    assert not queue.offer("c", 0.0)
    assert (len(queue), queue.num_rejected, queue.peek()) == (2, 1, "a")
    assert not AdmissionQueue[str](max_len=0).offer("x", 0.0)


def test_pop_ready_is_strict_fifo() -> None:
    queue: AdmissionQueue[int] = AdmissionQueue(max_len=8)
    for size in (1, 5, 1):
        queue.offer(size, 0.0)
    capacity = [3]

    def place(size: int) -> str | None:
        if size > capacity[0]:
            return None
        capacity[0] -= size
        return f"w{size}"

    # The big request at the head blocks the small one behind it (no starvation).
    assert queue.pop_ready(place, 1.0) == [(1, "w1")]
    assert len(queue) == 2 and queue.peek() == 5
    capacity[0] = 10
    assert queue.pop_ready(place, 2.0) == [(5, "w5"), (1, "w1")]
    assert len(queue) == 0 and queue.pop_ready(place, 3.0) == []


def test_expire_and_remove() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=8, max_wait_s=10.0)
    queue.offer("a", 0.0)
    queue.offer("b", 5.0)
    queue.offer("c", 6.0)
    assert queue.remove("c") and not queue.remove("c")
    assert queue.expire(10.0) == []
    assert queue.expire(15.5) == ["a", "b"]
    assert queue.num_expired == 2 and len(queue) == 0
    assert AdmissionQueue[str](max_len=1).expire(1e9) == []


def test_retry_after_follows_the_service_rate() -> None:
    queue: AdmissionQueue[int] = AdmissionQueue(max_len=4, min_retry_after_s=1.0,
                                                max_retry_after_s=60.0)
    assert queue.retry_after_s(0.0) == 60.0  # nothing served yet
    for i in range(4):
        queue.offer(i, 0.0)
    for t in range(4):  # one placed per second
        room = [1]

        def place(item: int) -> str | None:
            room[0] -= 1
            return "ok" if room[0] >= 0 else None

        assert queue.pop_ready(place, float(t)) == [(t, "ok")]
        queue.offer(10 + t, float(t))
    # 4 placed over [0, 4] s = 1/s; 4 waiting + the rejected one = 5 s.
    assert queue.retry_after_s(4.0) == pytest.approx(5.0)
    assert queue.retry_after_s(100.0) == 60.0  # the window forgot them: stuck


def test_service_rate_and_clamp() -> None:
    rate = ServiceRate(window_s=10.0)
    assert rate.rate(0.0) is None
    rate.record(5.0)
    assert rate.rate(5.0) == 1.0  # one event counts over at least one second
    for t in (6.0, 7.0, 8.0):
        rate.record(t)
    assert rate.rate(9.0) == pytest.approx(1.0)
    assert retry_after_s(99, 100.0, 1.0, 60.0) == 1.0
    assert retry_after_s(99, 1.0, 1.0, 60.0) == 60.0
    assert retry_after_s(9, 2.0, 1.0, 60.0) == 5.0
