"""AdmissionQueue: bound, strict FIFO placement, removal; the Retry-After estimate."""
from __future__ import annotations

import pytest

from splitserve.cluster.router.admission import AdmissionQueue, ServiceRate, retry_after_s


def test_full_queue_rejects() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=2)
    assert queue.offer("a") and queue.offer("b")
    assert not queue.offer("c")
    assert len(queue) == 2
    assert not AdmissionQueue[str](max_len=0).offer("x")
    with pytest.raises(ValueError, match="max_len=-1"):
        AdmissionQueue[str](max_len=-1)


def test_pop_ready_is_strict_fifo() -> None:
    queue: AdmissionQueue[int] = AdmissionQueue(max_len=8)
    for size in (1, 5, 1):
        queue.offer(size)
    capacity = [3]

    def place(size: int) -> str | None:
        if size > capacity[0]:
            return None
        capacity[0] -= size
        return f"w{size}"

    # The big request at the head blocks the small one behind it (no starvation).
    assert queue.pop_ready(place) == [(1, "w1")]
    assert len(queue) == 2
    capacity[0] = 10
    assert queue.pop_ready(place) == [(5, "w5"), (1, "w1")]
    assert len(queue) == 0 and queue.pop_ready(place) == []


def test_remove() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(max_len=8)
    for item in ("a", "b", "c"):
        queue.offer(item)
    assert queue.remove("b") and not queue.remove("b")
    assert queue.pop_ready(lambda item: item) == [("a", "a"), ("c", "c")]


def test_service_rate_and_clamp() -> None:
    rate = ServiceRate(window_s=10.0)
    assert rate.rate(0.0) is None
    rate.record(5.0)
    assert rate.rate(5.0) == 1.0  # one event counts over at least one second
    for t in (6.0, 7.0, 8.0):
        rate.record(t)
    assert rate.rate(9.0) == pytest.approx(1.0)
    assert rate.rate(100.0) is None  # the window forgot them
    assert retry_after_s(99, 100.0, 1.0, 60.0) == 1.0
    assert retry_after_s(99, 1.0, 1.0, 60.0) == 60.0
    assert retry_after_s(9, 2.0, 1.0, 60.0) == 5.0
    assert retry_after_s(9, None, 1.0, 60.0) == 60.0  # nothing served lately
