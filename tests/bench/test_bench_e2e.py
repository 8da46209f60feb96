"""`splitserve bench` (the CLI, as a subprocess) against a real `splitserve serve`: a tiny
sweep (all at once, then Poisson), checked through its JSON report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def server(start_server: Any) -> Any:
    return start_server("--mode", "disagg", "--threads-per-worker", "1",
                        "--max-model-len", "2048")


def test_tiny_sweep_against_a_real_server(server: Any, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "splitserve.cli", "bench", "--base-url", server.url,
           "--num-requests", "6", "--dist", "uniform", "--input-len", "48", "--len-spread",
           "0.33", "--output-len", "8", "--output-dist", "fixed", "--rate-sweep", "inf,4",
           "--slo-ttft-ms", "5000", "--slo-tpot-ms", "1000", "--output-dir", str(tmp_path),
           "--label", "e2e", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:] + server.log()
    assert "# bench sweep `e2e`" in res.stdout
    assert {p.name for p in tmp_path.iterdir()} == {
        "e2e.json", "e2e.md", "e2e_attainment.png", "e2e_ttft_cdf.png", "e2e_tpot_cdf.png"}
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert [row["rate"] for row in data["summary"]] == ["inf", 4.0]
    assert data["command"].startswith("splitserve bench --base-url")
    for run, kind in zip(data["runs"], ["all at once", "poisson"]):
        assert {"config", "machine", "command", "date", "server", "workload", "arrivals",
                "summary", "server_breakdown", "requests"} <= run.keys()
        assert run["arrivals"]["kind"] == kind
        assert run["server"]["max_model_len"] == 2048
        s = run["summary"]
        assert s["num_sent"] == 6 == s["num_completed"] + s["num_failed"]
        assert s["num_completed"] == 6, s["errors"]
        assert s["output_tokens"] == s["intended_output_tokens"] == 48
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert s[key]["count"] > 0 and s[key]["p99"] >= s[key]["median"] > 0
        assert 0.0 <= s["slo_attainment"] <= 1.0 and s["goodput"] >= 0.0
        for r in run["requests"]:
            assert r["error"] is None and r["status"] == 200 and r["usage_reported"]
            assert r["output_tokens"] == r["intended_output_len"] == 8
            assert r["prompt_tokens"] == r["prompt_len"]  # the server saw the exact prompt
            assert 32 <= r["prompt_len"] <= 64
            assert len(r["chunk_s"]) >= 1 and r["send_s"] >= r["scheduled_s"] - 1e-3
        breakdown = run["server_breakdown"]
        assert breakdown is not None
        hist = {(h["name"], tuple(sorted(h["labels"].items()))): h
                for h in breakdown["histograms"]}
        assert hist[("splitserve_time_to_first_token_seconds", ())]["count"] == 6
        assert hist[("splitserve_queue_time_seconds", (("phase", "admission"),))]["count"] == 6
        counters = {(c["name"], tuple(c["labels"].items())): c["value"]
                    for c in breakdown["counters"]}
        assert counters[("splitserve_requests_total", (("outcome", "length"),))] == 6
        decisions = [v for (name, _), v in counters.items()
                     if name == "splitserve_router_decisions_total"]
        assert sum(decisions) == 6
