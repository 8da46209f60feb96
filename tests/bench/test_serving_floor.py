"""The serving tax's floor server (benchmarks/serving_floor.py): a request through it streams
the engine's tokens to the openai client, and stopping it leaves no process behind."""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
from benchmarks import serving  # noqa: E402
from benchmarks.common import descendants  # noqa: E402
from processes import pid_alive  # noqa: E402
from benchmarks.serving_floor import FloorServer  # noqa: E402


def test_floor_server_streams_and_stops_clean(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "PROMPT_TOKENS", 8)
    monkeypatch.setattr(serving, "OUTPUT_TOKENS", 3)
    server = FloorServer()
    try:
        processes = descendants(server.proc.pid)
        assert len(processes) >= 2  # the frontend and its engine worker
        first = server.run(0)
        second = server.run(1)
        assert 0 < first.ttft_s < 60 and 0 < second.ttft_s < 60
        assert first.first_event_s is not None and first.tpot_s > 0
    finally:
        server.stop()
    assert server.proc.returncode == 0  # uvicorn's SIGTERM re-raise would make it -15
    # multiprocessing's resource tracker leaves when its pipe closes, a moment later
    deadline = time.monotonic() + 10
    while [p for p in processes if pid_alive(p)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in processes if pid_alive(p)]

