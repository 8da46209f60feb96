"""A worker's load reports: every change goes out at the report interval, a repeat only
once per heartbeat interval (an idle worker still heartbeats, at a tenth of the rate)."""
from __future__ import annotations

import pytest

from splitserve.cluster import protocol as P
from splitserve.cluster.worker import reports as reports_module
from splitserve.cluster.worker.reports import Reports
from splitserve.engine.engine import EngineLoad


class _Engine:
    """What Reports reads of an engine: its load and its last step."""

    def __init__(self) -> None:
        self.running = 0
        self.last_step: object | None = None

    def load(self) -> EngineLoad:
        return EngineLoad(num_running=self.running, num_waiting=0, num_prefilling=0,
                          num_waiting_tokens=0, num_awaiting_kv=0, kv_blocks_used=self.running,
                          kv_blocks_total=64, max_num_seqs=8)


class _Step:
    num_prefill_tokens, num_decode_seqs, seconds = 0, 1, 0.01


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(reports_module.time, "monotonic", lambda: now[0])
    return now


def _due_reports(reports: Reports, engine: _Engine, clock: list[float],
                 seconds: float) -> list[P.LoadReport]:
    """The reports sent over `seconds`, asked for whenever one is due (as Worker.run)."""
    sent = []
    end = clock[0] + seconds
    while clock[0] < end:
        if reports.is_due():
            report = reports.load_report(engine, None, [])  # type: ignore[arg-type]
            if report is not None:
                sent.append(report)
        clock[0] += 0.01
    return sent


def test_an_idle_worker_heartbeats_at_the_heartbeat_interval(clock: list[float]) -> None:
    engine, reports = _Engine(), Reports(interval_s=0.1, heartbeat_s=1.0)
    sent = _due_reports(reports, engine, clock, 5.0)
    assert 5 <= len(sent) <= 6  # the first at once, then one a second (not 50)
    assert all(r == sent[0] for r in sent)


def test_a_change_or_a_step_is_reported_at_the_next_interval(clock: list[float]) -> None:
    engine, reports = _Engine(), Reports(interval_s=0.1, heartbeat_s=1.0)
    _due_reports(reports, engine, clock, 1.5)  # idle for a while
    engine.running = 3
    sent = _due_reports(reports, engine, clock, 0.15)
    assert [r.num_running for r in sent] == [3]
    reports.step_done(engine)  # type: ignore[arg-type]  # no step recorded yet
    engine.last_step = _Step()
    for _ in range(4):
        reports.step_done(engine)  # type: ignore[arg-type]
    sent = _due_reports(reports, engine, clock, 0.15)
    assert len(sent) == 1 and len(sent[0].steps) == 4  # busy: every interval, steps in it
    sent = _due_reports(reports, engine, clock, 0.5)
    # the steps were sent once; the next report carries none, then repeats are held back
    assert [len(r.steps) for r in sent] == [0]


def test_a_report_names_the_requests_received_since_the_last_one(clock: list[float]) -> None:
    """The router keeps counting a request it dispatched until a report names it
    (router/load.py): each id goes out in exactly one report, the first after it came."""
    engine, reports = _Engine(), Reports(interval_s=0.1, heartbeat_s=1.0)
    _due_reports(reports, engine, clock, 1.5)  # idle: the repeats are held back
    reports.request_received("r0")
    reports.request_received("r1")
    sent = _due_reports(reports, engine, clock, 0.15)
    assert [r.received for r in sent] == [["r0", "r1"]]  # at once, though nothing else changed
    reports.request_received("r2")
    engine.running = 1
    sent = _due_reports(reports, engine, clock, 0.5)
    assert [r.received for r in sent] == [["r2"]]
