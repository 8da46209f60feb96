"""The prefill worker's handoff bookkeeping (cluster/worker/handoff.py) against a recording
sender and engine: whichever of the plan and the end of the prefill comes first, the KV
is sent exactly once, by the right call; without a plan it is released at the deadline.
The real sender and engine run this path in tests/api/test_serving_e2e.py."""
from __future__ import annotations

from typing import Any

from splitserve.cluster.worker.handoff import Handoffs
from splitserve.transfer.handle import TransferPlan

PLAN = TransferPlan("t1", "r1", None, "tcp://127.0.0.1:1", 0, 32, 5.0)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, *args))


def make() -> tuple[Handoffs, Recorder, Recorder]:
    engine, sender = Recorder(), Recorder()
    return Handoffs(engine, sender), engine, sender  # type: ignore[arg-type]


def test_a_plan_during_the_prefill_streams_the_layers() -> None:
    h, engine, sender = make()
    h.add("r1", None, kv_timeout_s=5.0)
    h.on_plan("r1", PLAN)
    h.on_prefilled("r1", 42)  # the prefill ends after the plan: nothing more to do
    assert sender.calls == [("start", "r1", PLAN)] and engine.calls == []


def test_a_plan_after_the_prefill_sends_the_held_kv_with_token_1() -> None:
    h, engine, sender = make()
    h.add("r1", None, kv_timeout_s=5.0)
    h.on_prefilled("r1", 42)
    h.on_plan("r1", PLAN)
    h.on_plan("r1", PLAN)  # a repeat is moot
    assert sender.calls == [("send_held", "r1", PLAN, 42)] and engine.calls == []


def test_no_plan_by_the_deadline_releases_the_kv_once() -> None:
    h, engine, sender = make()
    h.add("r1", None, kv_timeout_s=0.0)
    assert h.expire(now=1e18) == []  # still prefilling: nothing held yet
    h.on_prefilled("r1", 42)
    assert h.expire(now=1e18) == ["r1"] and h.expire(now=1e18) == []
    assert engine.calls == [("release_kv", "r1")] and sender.calls == [("cancel", "r1")]
    h.on_plan("r1", PLAN)  # too late
    assert sender.calls == [("cancel", "r1")] and len(h) == 0


def test_a_request_that_ends_at_token_1_is_the_caller_s_to_release() -> None:
    h, _, sender = make()
    h.add("r1", None, kv_timeout_s=5.0)
    assert h.end_early("r1") and not h.end_early("r1")
    h.add("r2", None, kv_timeout_s=5.0)
    h.on_plan("r2", PLAN)
    assert not h.end_early("r2")  # its transfer runs and releases the KV itself
