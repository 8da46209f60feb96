"""The planner inside a real server (local runtime): with `--planner advisory` it decides
every interval from what the cluster measured, reports each decision with its reasons
(/admin/health, /metrics) and changes nothing, under no load and under a burst."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from openai import OpenAI


def _decision(server: Any, after: float, timeout_s: float = 30.0) -> dict[str, Any]:
    """The first planner decision reported after `after` (monotonic seconds)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decision = server.get_json("/admin/health").get("planner")
        if decision is not None and time.monotonic() > after:
            return dict(decision)
        time.sleep(0.3)
    raise AssertionError(f"no planner decision in {timeout_s} s: {server.log()}")


def test_advisory_planner_reports_decisions_and_acts_on_none(start_server: Any) -> None:
    server = start_server("--prefill", "1", "--decode", "1", "--planner", "advisory",
                          "--planner-interval-s", "1", "--slo-ttft-ms", "2000",
                          "--slo-tpot-ms", "25", "--planner-max-workers", "4")
    before = {w["id"]: w["pid"] for w in server.workers()}
    idle = _decision(server, time.monotonic() + 2)
    assert idle["mode"] == "advisory" and idle["reasons"], idle
    assert idle["layout"] in ("disagg", "agg")
    # No --planner-model-load-s: the two workers' own start-to-registered times.
    load = idle["model_load"]
    assert load["source"] == "measured" and load["samples"] == 2, load
    assert 0 < load["seconds"] < 600, load

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id

    def one(i: int) -> None:
        client.completions.create(model=model, prompt=f"Story number {i}:", max_tokens=120,
                                  temperature=0, extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    busy = _decision(server, time.monotonic() + 3)
    for t in threads:
        t.join(300)
    assert busy["predicted"]["rate"] > 0, busy  # it saw the burst
    text = server.get_text("/metrics")
    assert 'splitserve_planner_target_workers{role="decode"}' in text
    # Advisory: whatever it advised, nothing was applied and no worker changed.
    assert 'result="applied"' not in text and busy["applied"] == []
    assert {w["id"]: w["pid"] for w in server.workers()} == before


def test_a_worker_gone_for_good_leaves_the_planners_view(start_server: Any) -> None:
    """With --no-restart-workers a decode worker that exits is not replaced: the planner
    then sees one decode worker, not two with one warming up for ever (which would hold
    off every scale-up and curve correction)."""
    server = start_server("--prefill", "1", "--decode", "2", "--planner", "advisory",
                          "--planner-interval-s", "1", "--slo-ttft-ms", "2000",
                          "--slo-tpot-ms", "100", "--no-restart-workers")
    _view(server, "1P+2D, 0 warming")  # each registered a model load ago
    victim = next(w for w in server.workers() if w["id"] == "decode-1")
    os.kill(int(victim["pid"]), signal.SIGKILL)
    _view(server, "1P+1D, 0 warming")
    assert "decode-1 exited and is not restarted" in server.log()


def _view(server: Any, text: str, timeout_s: float = 60.0) -> None:
    """Until a planner decision's first reason (what it measured) contains `text`."""
    deadline, seen = time.monotonic() + timeout_s, ""
    while text not in seen:
        assert time.monotonic() < deadline, f"planner still sees: {seen}"
        seen = _decision(server, time.monotonic() + 1)["reasons"][0]


def _steps(server: Any, kind: str, result: str = "applied") -> float:
    key = f'splitserve_planner_steps_total{{kind="{kind}",result="{result}"}}'
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.get_text("/metrics").splitlines()
               if line.startswith(key))


def test_planner_on_grows_under_a_burst_and_returns_to_minimums(start_server: Any) -> None:
    """--planner on, a 1 s interval: a burst of long streams under a tight TPOT target
    makes it add workers (applied through the cluster); when traffic stops it drains back
    to its minimums. Every stream's text is what the same request gives undisturbed
    (greedy; batch-invariant, so placement and moves cannot change it)."""
    server = start_server("--prefill", "1", "--decode", "1", "--planner", "on",
                          "--planner-interval-s", "1", "--planner-model-load-s", "3",
                          "--slo-ttft-ms", "3000", "--slo-tpot-ms", "20",
                          "--planner-max-workers", "3")
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    texts = [""] * 16

    def one(i: int) -> None:
        texts[i] = str(client.completions.create(
            model=model, prompt=f"Chapter {i}. The night was", max_tokens=200,
            temperature=0, extra_body={"ignore_eos": True}).choices[0].text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while _steps(server, "add") < 1:
        assert time.monotonic() < deadline, server.get_json("/admin/health")["planner"]
        time.sleep(0.5)
    for t in threads:
        t.join(600)
    assert all(texts)
    deadline = time.monotonic() + 120
    # Back to the minimums: 1 prefill + 1 decode worker (or 1 colocated), by a drain.
    while len(server.workers()) > 2 or _steps(server, "remove") < 1:
        assert time.monotonic() < deadline, server.get_json("/admin/health")["planner"]
        time.sleep(0.5)
    for i in (0, 7, 15):  # undisturbed now: one at a time, on whatever is left
        one_text = str(client.completions.create(
            model=model, prompt=f"Chapter {i}. The night was", max_tokens=200,
            temperature=0, extra_body={"ignore_eos": True}).choices[0].text)
        assert one_text == texts[i]
    assert server.restarts() == 0
    for _, pool in server.get_json("/admin/pools")["workers"].items():
        assert pool["ok"] and pool["used_blocks"] == 0, pool
